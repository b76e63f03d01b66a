/* Aligned anonymous memory for I/O, one allocator for HostBuffer (module.c)
 * and the GPU staging pool (gpu.c): 4 KiB-aligned, or 2 MiB-aligned with
 * MADV_HUGEPAGE; always MADV_DONTFORK (a forked child neither copies it nor
 * shares pages the kernel or a device may still be writing); optionally bound
 * to a NUMA node (mbind, MPOL_PREFERRED, by syscall: no libnuma) before its
 * pages are faulted in, and optionally pre-faulted. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "fxio.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MADV_DONTFORK
#define MADV_DONTFORK 10
#endif
#define FX_MPOL_PREFERRED 1

int fx_mem_alloc(fx_mem *m, size_t size, int huge, int numa_node, int prefault)
{
    size_t map, over;
    char *p;

    memset(m, 0, sizeof(*m));
    m->numa_node = -1;
    if (!size)
        return -EINVAL;
    map = huge ? (size + FX_HUGE_2M - 1) & ~(size_t)(FX_HUGE_2M - 1)
               : (size + FX_DIO_ALIGN - 1) & ~(size_t)(FX_DIO_ALIGN - 1);
    over = huge ? FX_HUGE_2M : 0; /* room to align the start to 2 MiB */
    p = mmap(NULL, map + over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return -errno;
    if (huge) {
        char *a = (char *)(((uintptr_t)p + FX_HUGE_2M - 1) & ~(uintptr_t)(FX_HUGE_2M - 1));
        size_t head = (size_t)(a - p), tail = over - head;

        if (head)
            munmap(p, head);
        if (tail)
            munmap(a + map, tail);
        p = a;
        (void)madvise(p, map, MADV_HUGEPAGE);
    }
    (void)madvise(p, map, MADV_DONTFORK);
    if (numa_node >= 0 && numa_node < 1024) {
        unsigned long mask[1024 / (8 * sizeof(unsigned long))];

        memset(mask, 0, sizeof(mask));
        mask[numa_node / (8 * sizeof(unsigned long))] = 1ul << (numa_node % (8 * sizeof(unsigned long)));
        if (syscall(SYS_mbind, p, map, FX_MPOL_PREFERRED, mask, (unsigned long)(8 * sizeof(mask) + 1), 0ul) == 0)
            m->numa_node = numa_node;
        else
            m->numa_err = errno;
    }
    if (prefault && madvise(p, map, MADV_POPULATE_WRITE) < 0)
        memset(p, 0, map); /* fault in (before pinning, say) */
    m->addr = p;
    m->mapped = map;
    m->huge = huge;
    return 0;
}

void fx_mem_free(fx_mem *m)
{
    if (m->addr)
        munmap(m->addr, m->mapped);
    m->addr = NULL;
    m->mapped = 0;
}
