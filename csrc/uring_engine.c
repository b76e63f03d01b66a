/* The io_uring engine. One ring runs one batch at a time; rings are kept in a
 * small free list so several Python threads can run batches at once without
 * sharing a ring. Every piece that was submitted is reaped before a batch
 * returns and before its ring is freed, on every path and whatever the waits
 * return (a signal's EINTR included), because the kernel writes into caller
 * memory. When no ring can be had (out of file descriptors, say) the batch
 * runs with pread/pwrite on the calling thread instead. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "ring.h"

#ifdef FX_HAVE_LIBURING

#define MAX_FREE_RINGS 16
#define FIXED_IOV_MAX (1ull << 30) /* kernel limit per registered iovec */

struct fx_uring {
    pthread_mutex_t mu;
    fx_ring *free_list[MAX_FREE_RINGS];
    int nfree;
    unsigned qd;
    /* Fixed buffers: one table per ring holding every region, region 0 the
     * one fx_uring_register sets (LMCache's pool), the others added by
     * fx_uring_register_extra (a GPU staging pool); each region is cut into
     * iovecs of at most FIXED_IOV_MAX, region i's from first[i] on. */
    struct {
        char *base; /* NULL: unused */
        size_t len;
        unsigned first;
    } reg[FX_URING_REGIONS];
    int reg_gen;
    int reg_ok;
    fx_ring *donor; /* holds the registration; new rings clone it */
    /* Slots in flight over all rings, bounded by qd, so concurrent batches
     * share the device instead of each adding qd more. A read piece takes
     * one slot per started MiB (SLOT_BYTES, at most qd), so bigger pieces
     * keep the bytes in flight, and with them the wait of a request that
     * arrives behind them, at what qd 1 MiB pieces hold; a write piece takes
     * one. Which batch gets a free slot: one holding none waits for its
     * first in arrival order (tickets), so every batch keeps a piece in
     * flight; beyond that, slots go to the batch with the fewest slots'
     * worth left to queue (the earliest to arrive among equals). A burst of
     * equal requests is then served in turn, most of them done well before
     * the last, where equal shares ended them all together with the last;
     * a short request arriving behind long ones still goes first. */
    pthread_mutex_t slot_mu;
    pthread_cond_t slot_cv;
    unsigned slots_used;
    unsigned slot_waiters;
    unsigned long ticket_next, ticket_serve;
    struct run_state *wanting; /* batches with pieces left to queue */
    unsigned long arrivals;
    unsigned long slots_freed; /* ever returned: the order batches ended in, in device work */
    unsigned gen; /* process generation it was made in (fork guard) */
};

/* Reads served from memory (fx_piece.mem) of at least this many bytes go
 * to io-wq (IOSQE_ASYNC): completed inline they would all be copied by the
 * submitting thread, one core for the whole batch. Smaller ones stay inline,
 * where a hand-off would cost more than the copy. LMCACHE_FX_MEM_ASYNC
 * overrides it (bytes; 0 = never), read when an engine is made. Only batches
 * partly on disk come here with such reads: one wholly in memory runs on
 * threads (module.c, engine_run). */
#define MEM_ASYNC_MIN_DEFAULT (128u << 10)
static uint64_t mem_async_min = MEM_ASYNC_MIN_DEFAULT;

/* io-wq workers a ring's submitting threads may use for such copies: one
 * per CPU this process may run on (more only adds switching). */
static unsigned iowq_workers(void)
{
    cpu_set_t set;
    int n = 0;

    if (sched_getaffinity(0, sizeof(set), &set) == 0)
        n = CPU_COUNT(&set);
    return n > 0 ? (unsigned)n : 1;
}

/* io-wq workers for an engine ring (0: leave the kernel's default). */
static unsigned engine_iowq(void) { return mem_async_min ? iowq_workers() : 0; }

/* Registers every region as one table on ring (setting their first
 * indices); 0 when there is none, or -errno. */
#define REG_RESERVED ((char *)-1) /* an extra region being set up */
#define REG_LIVE(u, i) ((u)->reg[i].base && (u)->reg[i].base != REG_RESERVED)

static int register_region(fx_uring *u, fx_ring *ring)
{
    size_t n = 0, k = 0;
    struct iovec *iov;
    int r;

    for (int i = 0; i < FX_URING_REGIONS; i++)
        if (REG_LIVE(u, i))
            n += (u->reg[i].len + FIXED_IOV_MAX - 1) / FIXED_IOV_MAX;
    if (!n)
        return 0;
    if (!(iov = calloc(n, sizeof(*iov))))
        return -ENOMEM;
    for (int i = 0; i < FX_URING_REGIONS; i++) {
        if (!REG_LIVE(u, i))
            continue;
        u->reg[i].first = (unsigned)k;
        for (size_t off = 0; off < u->reg[i].len; off += FIXED_IOV_MAX, k++) {
            iov[k].iov_base = u->reg[i].base + off;
            iov[k].iov_len = u->reg[i].len - off < FIXED_IOV_MAX ? u->reg[i].len - off : FIXED_IOV_MAX;
        }
    }
    r = fx_ring_register_buffers(ring, iov, (unsigned)n);
    free(iov);
    return r;
}

static int any_region(const fx_uring *u)
{
    for (int i = 0; i < FX_URING_REGIONS; i++)
        if (REG_LIVE(u, i))
            return 1;
    return 0;
}

/* IORING_REGISTER_CLONE_BUFFERS (Linux 6.12+; liburing 2.3 predates it):
 * shares another ring's buffer table instead of pinning the pages again,
 * which for a pool of gigabytes takes hundreds of milliseconds per ring. */
#define FX_REGISTER_CLONE_BUFFERS 30
struct fx_clone_buffers {
    uint32_t src_fd, flags, src_off, dst_off, nr, pad[3];
};

static int clone_from(const fx_ring *donor, fx_ring *s)
{
    struct fx_clone_buffers arg;

    if (FX_FAULT(FX_FAULT_NO_CLONE))
        return -EINVAL; /* tests: a kernel before 6.12 */
    memset(&arg, 0, sizeof(arg));
    arg.src_fd = (uint32_t)donor->ring.ring_fd;
    return io_uring_register((unsigned)s->ring.ring_fd, FX_REGISTER_CLONE_BUFFERS, &arg, 1);
}

static int clone_registration(fx_uring *u, fx_ring *s) { return u->donor ? clone_from(u->donor, s) : -ENOENT; }

/* Without the clone, every ring pins the whole table again, one ring at a
 * time under the engine's lock: with a 4 GiB pool of 4 KiB pages, 16 reads
 * at once after start-up took 1.46 s instead of 12 ms (each ring ~0.1 s of
 * pinning, and each counted again against RLIMIT_MEMLOCK). So without it a
 * table over FX_FIXED_PER_RING_MAX is not registered at all (plain reads,
 * whose pages the kernel pins per request); a smaller one, such as a GPU
 * staging pool, is registered on each ring. */
static size_t table_bytes(const fx_uring *u)
{
    size_t n = 0;

    for (int i = 0; i < FX_URING_REGIONS; i++)
        if (REG_LIVE(u, i))
            n += u->reg[i].len;
    return n;
}

/* Whether this kernel clones one ring's registration into another: tried
 * once with a page of its own (kept for the process while no fault points
 * are armed), so a table it could not share is not pinned just to learn. */
static int clone_supported(void)
{
    static char page[4096] __attribute__((aligned(4096)));
    static _Atomic int known = -1;
    struct iovec iov = {.iov_base = page, .iov_len = sizeof(page)};
    fx_ring *a, *b = NULL;
    int err, r = -1, ok = 0;

    if (known >= 0 && !fx_fault_on)
        return known;
    if (!(a = fx_ring_new(1, 0, &err)))
        return 0;
    if (fx_ring_register_buffers(a, &iov, 1) == 0 && (b = fx_ring_new(1, 0, &err)))
        ok = (r = clone_from(a, b)) == 0;
    /* Kept only where both rings and the registration were made and the clone
     * answered yes or EINVAL (a kernel without it): a probe short of
     * descriptors or memory says nothing of the kernel. */
    if (b && (ok || r == -EINVAL) && !fx_fault_on)
        known = ok;
    fx_ring_discard(b);
    fx_ring_discard(a);
    return ok;
}

/* Brings a ring's fixed buffers in line with the engine's current region. */
static void sync_registration(fx_uring *u, fx_ring *s)
{
    if (s->reg_gen == u->reg_gen)
        return;
    if (s->reg_gen)
        io_uring_unregister_buffers(&s->ring);
    s->reg_gen = 0;
    if (any_region(u) && u->reg_ok &&
        (clone_registration(u, s) == 0 || (table_bytes(u) <= FX_FIXED_PER_RING_MAX && register_region(u, s) == 0)))
        s->reg_gen = u->reg_gen;
}

static void drop_donor(fx_uring *u)
{
    fx_ring_discard(u->donor);
    u->donor = NULL;
}

fx_ring *fx_uring_take_ring(fx_uring *u)
{
    fx_ring *s = NULL;
    int err;

    if (FX_FORKED(u->gen))
        return NULL; /* the rings are the parent's */
    pthread_mutex_lock(&u->mu);
    if (u->nfree)
        s = u->free_list[--u->nfree];
    pthread_mutex_unlock(&u->mu);
    if (!s && !(s = fx_ring_new(u->qd, engine_iowq(), &err)))
        return NULL;
    pthread_mutex_lock(&u->mu);
    sync_registration(u, s);
    pthread_mutex_unlock(&u->mu);
    return s;
}

int fx_uring_give_ring(fx_uring *u, fx_ring *s)
{
    if (s->inflight || s->queued)
        return -EBUSY; /* the kernel may still write into the caller's memory */
    pthread_mutex_lock(&u->mu);
    if (u->nfree < MAX_FREE_RINGS) {
        u->free_list[u->nfree++] = s;
        s = NULL;
    }
    pthread_mutex_unlock(&u->mu);
    fx_ring_discard(s);
    return 0;
}

int fx_uring_available(void) { return 1; }

/* What an ENOMEM from io_uring_setup points to: kernels before 5.12 charge
 * a ring to RLIMIT_MEMLOCK, later ones to the memory cgroup; an
 * address-space limit fails the ring's mappings the same way. */
static const char *enomem_hint(void)
{
    struct rlimit as;

    if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY)
        return " (no memory for the ring: an address-space limit (ulimit -v) is set; on kernels before 5.12, "
               "the memlock limit)";
    return " (no memory for the ring: the memory cgroup's limit, or on kernels before 5.12 the memlock limit)";
}

/* kernel.io_uring_disabled (Linux 6.6+): 0, 1 or 2; -1 where there is none.
 * Tells an EPERM from it apart from one of a seccomp profile. */
static int io_uring_disabled_sysctl(void)
{
    int fd = open("/proc/sys/kernel/io_uring_disabled", O_RDONLY | O_CLOEXEC);
    char b[8] = {0};
    ssize_t n;

    if (fd < 0)
        return -1;
    n = read(fd, b, sizeof(b) - 1);
    close(fd);
    return n > 0 && b[0] >= '0' && b[0] <= '2' ? b[0] - '0' : -1;
}


fx_uring *fx_uring_create(unsigned qd, char *why, size_t whylen)
{
    fx_uring *u = calloc(1, sizeof(*u));
    struct io_uring_probe *probe;
    fx_ring *s;
    int r = 0;

    if (!u) {
        snprintf(why, whylen, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&u->mu, NULL);
    pthread_mutex_init(&u->slot_mu, NULL);
    pthread_cond_init(&u->slot_cv, NULL);
    u->qd = qd;
    u->gen = fx_fork_gen;
    {
        const char *v = getenv("LMCACHE_FX_MEM_ASYNC");
        char *end;
        unsigned long long x;

        if (v && *v) {
            errno = 0;
            x = strtoull(v, &end, 10);
            if (!errno && !*end)
                mem_async_min = x;
        } else {
            mem_async_min = MEM_ASYNC_MIN_DEFAULT;
        }
    }
    s = fx_ring_new(qd, engine_iowq(), &r);
    if (!s) {
        int disabled = io_uring_disabled_sysctl();
        const char *hint = r == -ENOSYS   ? " (kernel without io_uring, or a seccomp profile answering ENOSYS)"
                           : r == -EPERM  ? (disabled == 2   ? " (blocked: kernel.io_uring_disabled=2)"
                                             : disabled == 1 ? " (blocked: kernel.io_uring_disabled=1, and this "
                                                               "process is not in kernel.io_uring_group)"
                                                             : " (blocked by a seccomp profile)")
                           : r == -ENOMEM ? enomem_hint()
                                          : "";
        snprintf(why, whylen, "io_uring_setup failed: %s%s", strerror(-r), hint);
        goto fail;
    }
    probe = io_uring_get_probe_ring(&s->ring);
    if (probe) {
        int ok = io_uring_opcode_supported(probe, IORING_OP_READ) &&
                 io_uring_opcode_supported(probe, IORING_OP_WRITE);
        io_uring_free_probe(probe);
        if (!ok) {
            snprintf(why, whylen, "kernel io_uring lacks IORING_OP_READ/WRITE (needs 5.6+)");
            fx_ring_discard(s);
            goto fail;
        }
    }
    if ((r = fx_ring_works(s)) < 0) {
        snprintf(why, whylen, "io_uring_enter failed: %s%s", strerror(-r),
                 r == -EPERM || r == -ENOSYS ? " (io_uring_setup allowed, io_uring_enter blocked: a seccomp profile)" : "");
        fx_ring_discard(s);
        goto fail;
    }
    u->free_list[u->nfree++] = s;
    return u;
fail:
    pthread_mutex_destroy(&u->mu);
    pthread_mutex_destroy(&u->slot_mu);
    pthread_cond_destroy(&u->slot_cv);
    free(u);
    return NULL;
}

void fx_uring_destroy(fx_uring *u)
{
    if (!u)
        return;
    /* A forked child's copy shares the parent's rings (their memory is not
     * even mapped here) and maybe a lock held by a parent thread: leave it. */
    if (FX_FORKED(u->gen))
        return;
    for (int i = 0; i < u->nfree; i++)
        fx_ring_discard(u->free_list[i]);
    drop_donor(u);
    pthread_mutex_destroy(&u->mu);
    pthread_mutex_destroy(&u->slot_mu);
    pthread_cond_destroy(&u->slot_cv);
    free(u);
}

/* Sets region i to [addr, addr + len) (addr NULL: removes it) and registers
 * the new table on a small ring of its own (so a refusal, ENOMEM without
 * CAP_IPC_LOCK, is reported here); pool rings clone it when next taken. If
 * the table is refused, region i is left out (the others stay registered)
 * and the refusal returned: also -EOPNOTSUPP for a table over
 * FX_FIXED_PER_RING_MAX on a kernel that cannot clone it. */
static int set_region(fx_uring *u, int i, void *addr, size_t len)
{
    fx_ring *d = NULL;
    int r = 0, r2;

    if (!(d = fx_ring_new(1, 0, &r)) && addr) {
        if (i) {
            pthread_mutex_lock(&u->mu);
            u->reg[i].base = NULL; /* the reservation */
            pthread_mutex_unlock(&u->mu);
        }
        return r;
    }
    pthread_mutex_lock(&u->mu);
    drop_donor(u);
    u->reg[i].base = addr;
    u->reg[i].len = addr ? len : 0;
    u->reg_gen++;
    u->reg_ok = 0;
    if (addr && table_bytes(u) > FX_FIXED_PER_RING_MAX && !clone_supported())
        r = -EOPNOTSUPP; /* each ring would pin it again: see FX_FIXED_PER_RING_MAX */
    else
        r = d ? register_region(u, d) : 0;
    if (r < 0 && addr) {
        u->reg[i].base = NULL; /* without it, then */
        u->reg[i].len = 0;
        fx_ring_discard(d);
        d = fx_ring_new(1, 0, &r2);
        r2 = d ? register_region(u, d) : r2;
    } else {
        r2 = r;
    }
    if (d && r2 == 0 && any_region(u)) {
        d->reg_gen = u->reg_gen;
        u->donor = d;
        u->reg_ok = 1;
    } else {
        fx_ring_discard(d);
    }
    pthread_mutex_unlock(&u->mu);
    return r;
}

int fx_uring_register(fx_uring *u, void *addr, size_t len) { return set_region(u, 0, addr, len); }

int fx_uring_register_extra(fx_uring *u, void *addr, size_t len)
{
    int i, r;

    if (FX_FORKED(u->gen))
        return -EOWNERDEAD;
    pthread_mutex_lock(&u->mu);
    for (i = 1; i < FX_URING_REGIONS && u->reg[i].base; i++)
        ;
    if (i < FX_URING_REGIONS)
        u->reg[i].base = REG_RESERVED;
    pthread_mutex_unlock(&u->mu);
    if (i == FX_URING_REGIONS)
        return -ENOSPC;
    r = set_region(u, i, addr, len);
    return r < 0 ? r : i;
}

void fx_uring_unregister_extra(fx_uring *u, int handle)
{
    if (handle > 0 && handle < FX_URING_REGIONS && !FX_FORKED(u->gen))
        (void)set_region(u, handle, NULL, 0);
}

int fx_uring_registered(const fx_uring *u) { return u->reg[0].base && u->reg_ok; }

int fx_uring_shares_registration(void) { return clone_supported(); }

int fx_ring_fixed_index(fx_uring *u, const fx_ring *s, const void *addr, uint64_t len)
{
    uintptr_t a = (uintptr_t)addr;
    int found = -1;

    if (!s->reg_gen || !len)
        return -1;
    /* Under the lock: a registration changing the table meanwhile (another
     * thread's register_extra) must not be read half old, half new. */
    pthread_mutex_lock(&u->mu);
    /* A ring registered before the table last changed holds other indices. */
    for (int i = 0; s->reg_gen == u->reg_gen && i < FX_URING_REGIONS; i++) {
        uintptr_t b = (uintptr_t)u->reg[i].base;
        size_t idx;

        if (!REG_LIVE(u, i) || a < b || a + len > b + u->reg[i].len)
            continue;
        idx = (a - b) / FIXED_IOV_MAX;
        if ((a + len - 1 - b) / FIXED_IOV_MAX == idx)
            found = (int)(u->reg[i].first + idx);
        break;
    }
    pthread_mutex_unlock(&u->mu);
    return found;
}

/* Index of the registered iovec holding the whole piece, or -1. */
static int fixed_index(fx_uring *u, const fx_ring *s, const fx_piece *p)
{
    return fx_ring_fixed_index(u, s, p->buf, p->length);
}

/* Queues a piece on the ring: 0, or -EBUSY when the queue is full. */
static int queue_piece(fx_uring *u, fx_ring *s, const fx_batch *b, fx_piece *p)
{
    fx_io io = {.fd = b->ops[p->op].fd, .write = b->write, .buf = p->buf, .len = p->length,
                .off = p->offset, .fixed = -1, .tag = p};

    if (p->hdr) {
        /* Header and the piece's bytes in one vectored read. */
        p->iov[0].iov_base = p->hdr;
        p->iov[0].iov_len = FX_HDR_SIZE;
        p->iov[1].iov_base = p->buf;
        p->iov[1].iov_len = p->length;
        io.iov = p->iov;
        io.niov = p->length ? 2 : 1;
        io.off = p->offset - FX_HDR_SIZE;
    } else {
        io.fixed = fixed_index(u, s, p);
    }
    io.async = p->mem && mem_async_min && p->length + (p->hdr ? FX_HDR_SIZE : 0) >= mem_async_min;
    return fx_ring_queue(s, &io);
}

/* Staging for checked O_DIRECT reads (fx_batch.stage_direct): a staged
 * piece reads into a 1 MiB slot of a process-wide pool and, as it lands, is
 * copied to its place while summed (fx_piece_checksum). In the probe
 * (scripts/staged_direct_probe.py) 8-16 MiB staged in all read 1.04-1.25x a
 * checked read into place on the loop medium, 32 MiB 0.88-0.96x: staging
 * pays while it stays in the CPU's cache. So the pool is at most
 * STAGE_BUFFERS_PER_DEVICE buffers of STAGE_BUFFER_BYTES, made when a store that
 * stages opens (fx_stage_prepare) or else on first use, and kept (not per
 * thread: submit_chunks runs each batch on a thread of its
 * own; made and freed per batch, a 2 MiB page allocation and 8 MiB zeroed
 * each, p99 was 10.8x p50 for 2 MiB chunks at 16 in flight), and a batch
 * keeps at most STAGE_BATCH_MAX staged pieces in flight.
 *
 * Both per device, up to STAGE_DEVICES_MAX devices: a store striped over N
 * devices allows N times as many buffers, and a read over N devices N times
 * as many staged pieces in flight (round-robin over them), half the pool as
 * on one device, so that concurrent reads still find slots. With 8 per read,
 * eight RAM-backed devices on a 16-core host each had 0.5 reads in flight and
 * were idle 63% of the time (fio's jobs: 34 in flight,
 * scripts/inflight_probe.py). One device is as before.
 *
 * Slots go to pieces, not buffers to batches: with a buffer per batch the
 * first two of 16 concurrent requests held both, while the engine's slot
 * order served the others, which then all read in place (64 MiB at 16 in
 * flight: staged 1.05x the time of reading in place). A piece that finds
 * no slot free waits until one of its batch's own staged pieces is done, or,
 * when the batch holds none, reads in place. Every staged piece takes a
 * whole slot, so pieces under 1 MiB (split_bytes below the default) stage
 * fewer bytes in all. */
#define STAGE_SLOT ((size_t)1 << 20) /* the default split_bytes; larger pieces read in place */
#define STAGE_BUFFER_BYTES ((size_t)8 << 20)
#define STAGE_BUFFERS_PER_DEVICE 2 /* 16 MiB */
#define STAGE_DEVICES_MAX 8         /* staging scales with devices up to this many */
#define STAGE_BUFFERS_MAX (STAGE_DEVICES_MAX * STAGE_BUFFERS_PER_DEVICE) /* 128 MiB */
#define STAGE_SLOTS_PER_BUFFER (STAGE_BUFFER_BYTES / STAGE_SLOT)
#define STAGE_BATCH_MAX 8 /* 8 MiB in flight for a lone batch of 1 MiB pieces; 16 read level (build_ab_probe) */
#define STAGE_PIECE_MIN (64u << 10) /* below it a hand-off through a slot gains nothing */

static pthread_mutex_t stage_mu = PTHREAD_MUTEX_INITIALIZER;
static char *stage_free[STAGE_BUFFERS_MAX * STAGE_SLOTS_PER_BUFFER];
static unsigned stage_nfree, stage_made;
static unsigned stage_allowed = STAGE_BUFFERS_PER_DEVICE; /* raised by fx_stage_prepare for wider stores */
/* A buffer could not be made (RLIMIT_AS, no memory): none is tried again
 * until this time (fx_now_ns), else every piece would try the mapping. */
static uint64_t stage_failed_until;
#define STAGE_RETRY_NS 1000000000ull

static pthread_once_t stage_fork_once = PTHREAD_ONCE_INIT;

/* In a forked child: the parent's buffers are not mapped here
 * (MADV_DONTFORK), and another thread of the parent may have held the lock
 * at the fork. */
static void stage_fork_child(void)
{
    pthread_mutex_init(&stage_mu, NULL);
    stage_nfree = stage_made = 0;
    stage_allowed = STAGE_BUFFERS_PER_DEVICE; /* the child's own stores raise it again */
    stage_failed_until = 0;
}

static void stage_fork_install(void) { pthread_atfork(NULL, NULL, stage_fork_child); }

/* Takes the pool's lock, the child handler installed first: a fork while
 * the lock is held leaves the child one of its own. */
static void stage_lock(void)
{
    pthread_once(&stage_fork_once, stage_fork_install);
    pthread_mutex_lock(&stage_mu);
}

/* Adds one buffer's slots to the pool: 0, or -1 when no more may be made
 * (stage_allowed made, or a mapping failed before). */
static int stage_grow(void)
{
    fx_mem m;

    stage_lock();
    if (stage_made >= stage_allowed || fx_now_ns() < stage_failed_until) {
        pthread_mutex_unlock(&stage_mu);
        return -1;
    }
    stage_made++; /* reserved; made outside the lock */
    pthread_mutex_unlock(&stage_mu);
    if (fx_mem_alloc(&m, STAGE_BUFFER_BYTES, 1, -1, 1) != 0) {
        stage_lock();
        stage_made--;
        stage_failed_until = fx_now_ns() + STAGE_RETRY_NS;
        pthread_mutex_unlock(&stage_mu);
        return -1;
    }
    stage_lock();
    for (size_t i = 0; i < STAGE_SLOTS_PER_BUFFER; i++)
        stage_free[stage_nfree++] = m.addr + i * STAGE_SLOT;
    pthread_mutex_unlock(&stage_mu);
    return 0;
}

/* A free staging slot (to give back with stage_give), or NULL: every one is
 * in use and no more buffers may be made (or none could be). */
static char *stage_take(void)
{
    for (;;) {
        char *slot = NULL;

        stage_lock();
        if (stage_nfree)
            slot = stage_free[--stage_nfree];
        pthread_mutex_unlock(&stage_mu);
        if (slot)
            return slot;
        if (stage_grow() < 0)
            return NULL;
        /* Taken again: other threads may have emptied the new buffer meanwhile. */
    }
}

/* Makes every staging buffer now. A store that stages its reads calls it
 * when it opens: a buffer's 2 MiB pages are faulted in at once, and where
 * memory is fragmented the kernel compacts it first, 20-25 ms a buffer in
 * the bench's process, which the first read would otherwise wait for. */
unsigned fx_stage_prepare(unsigned devices)
{
    unsigned want = (devices < 1 ? 1 : devices > STAGE_DEVICES_MAX ? STAGE_DEVICES_MAX : devices) *
                    STAGE_BUFFERS_PER_DEVICE;

    stage_lock();
    if (want > stage_allowed)
        stage_allowed = want; /* never lowered: another store may be wider */
    pthread_mutex_unlock(&stage_mu);
    while (stage_grow() == 0)
        ;
    return fx_stage_buffers();
}

static void stage_give(char *slot)
{
    stage_lock();
    stage_free[stage_nfree++] = slot;
    pthread_mutex_unlock(&stage_mu);
}

unsigned fx_stage_buffers(void)
{
    unsigned n;

    stage_lock();
    n = stage_made;
    pthread_mutex_unlock(&stage_mu);
    return n;
}

typedef struct run_state {
    fx_batch *b;
    int64_t *done;      /* bytes done per piece, across short transfers */
    unsigned char *fin; /* piece finished */
    fx_piece **landed;  /* pieces reaped but not yet checksummed */
    int64_t *landed_res;
    unsigned nlanded;
    unsigned held; /* engine-wide slots this batch holds (queued or in flight) */
    /* In the engine's wanting list (pieces left to queue), under slot_mu:
     * slots' worth of pieces not yet queued, and when it arrived. */
    int wanting;
    uint64_t left;
    unsigned long arrival;
    unsigned long ended_at; /* slots_freed after this batch's last return */
    struct run_state *prev, *next;
    int stage_on;       /* the batch stages (fx_batch.stage_direct on a checked read) */
    unsigned staged_out; /* its pieces holding a staging slot */
    unsigned stage_max;  /* at most this many: STAGE_BATCH_MAX per device it reads from (half the pool) */
    size_t *order;       /* the order pieces are queued in (NULL: as they lie) */
} run_state;

#define SLOT_BYTES (1u << 20)

/* The engine-wide slots a piece takes (see fx_uring.slots_used). */
static unsigned piece_slots(const fx_uring *u, const fx_batch *b, const fx_piece *p)
{
    uint64_t n;

    if (b->write)
        return 1;
    n = (p->length + SLOT_BYTES - 1) / SLOT_BYTES; /* a fused header's 4 KiB rides free */
    return n < 1 ? 1 : n > u->qd ? u->qd : (unsigned)n;
}

/* Whether st comes first for free slots: the fewest slots' worth left to
 * queue, the earliest arrival among equals (under slot_mu). */
static int leads(const fx_uring *u, const run_state *st)
{
    for (const run_state *o = u->wanting; o; o = o->next)
        if (o != st && (o->left < st->left || (o->left == st->left && o->arrival < st->arrival)))
            return 0;
    return 1;
}

/* Engine-wide slots for a new piece (see fx_uring.slots_used). A batch
 * holding none waits for them, in arrival order; a batch holding some takes
 * more only while no batch waits and no other comes before it. Returns 0
 * when the caller should reap its own completions first. */
static int take_slot(fx_uring *u, run_state *st, unsigned n)
{
    int ok = 0;

    pthread_mutex_lock(&u->slot_mu);
    if (st->held == 0) {
        unsigned long t = u->ticket_next++;

        u->slot_waiters++;
        while (u->slots_used + n > u->qd || t != u->ticket_serve)
            pthread_cond_wait(&u->slot_cv, &u->slot_mu);
        u->slot_waiters--;
        u->ticket_serve++;
        if (u->slot_waiters)
            pthread_cond_broadcast(&u->slot_cv); /* the next ticket may go */
        ok = 1;
    } else {
        ok = u->slots_used + n <= u->qd && !u->slot_waiters && leads(u, st);
    }
    if (ok) {
        u->slots_used += n;
        st->held += n;
        st->left = st->left > n ? st->left - n : 0;
    }
    pthread_mutex_unlock(&u->slot_mu);
    return ok;
}

/* Enters (1) or leaves (0) the engine's list of batches with pieces left to
 * queue; entering, left is what the batch will queue in all. */
static void set_wanting(fx_uring *u, run_state *st, int on)
{
    if (st->wanting == on)
        return;
    pthread_mutex_lock(&u->slot_mu);
    if (on) {
        st->arrival = u->arrivals++;
        st->prev = NULL;
        st->next = u->wanting;
        if (u->wanting)
            u->wanting->prev = st;
        u->wanting = st;
    } else {
        if (st->prev)
            st->prev->next = st->next;
        else
            u->wanting = st->next;
        if (st->next)
            st->next->prev = st->prev;
        st->prev = st->next = NULL;
    }
    st->wanting = on;
    pthread_cond_broadcast(&u->slot_cv);
    pthread_mutex_unlock(&u->slot_mu);
}

static void give_slots(fx_uring *u, run_state *st, unsigned n)
{
    if (!n)
        return;
    pthread_mutex_lock(&u->slot_mu);
    u->slots_used -= n;
    st->held -= n;
    u->slots_freed += n;
    st->ended_at = u->slots_freed;
    pthread_cond_broadcast(&u->slot_cv);
    pthread_mutex_unlock(&u->slot_mu);
}

/* Gives back the slots take_slot just took for a piece that is not queued
 * after all (it waits for a staging slot): as if never taken. */
static void untake_slot(fx_uring *u, run_state *st, unsigned n)
{
    pthread_mutex_lock(&u->slot_mu);
    u->slots_used -= n;
    st->held -= n;
    st->left += n;
    pthread_cond_broadcast(&u->slot_cv);
    pthread_mutex_unlock(&u->slot_mu);
}

/* Whether a piece of the batch goes through a staging slot. */
static int stages(const run_state *st, const fx_piece *p)
{
    return st->stage_on && p->direct && !p->mem && p->length >= STAGE_PIECE_MIN && p->length <= STAGE_SLOT &&
           !fx_piece_needs_bounce(p);
}

/* Gives a staged piece's slot back (its bytes moved on or given up). */
static void unstage(run_state *st, fx_piece *p)
{
    if (!p->stage)
        return;
    stage_give(p->stage);
    st->staged_out--;
    p->stage = NULL;
    p->buf = p->start; /* as if never staged */
}

/* A piece is over (its CRC, if wanted, taken). */
static void piece_done(run_state *st, fx_piece *p, int64_t r)
{
    unstage(st, p);
    st->fin[p - st->b->pieces] = 1;
    if (fx_piece_finish(st->b, p, r))
        fx_op_complete(st->b, p->op);
}

static void finish(run_state *st, fx_piece *p, int64_t r)
{
    fx_piece_checksum(st->b, p, r);
    piece_done(st, p, r);
}

/* A piece is done; its CRC waits until the ring has been refilled. */
static void land(run_state *st, fx_piece *p, int64_t r)
{
    st->landed[st->nlanded] = p;
    st->landed_res[st->nlanded++] = r;
}

/* Handles one completion; returns 1 when the piece must be resubmitted. */
static int on_cqe(run_state *st, fx_piece *p, int res)
{
    size_t pi = (size_t)(p - st->b->pieces);
    int write = st->b->write;
    int64_t keep;

    if (res == -EAGAIN || res == -EINTR) {
        if (p->retries++ < FX_RETRY_MAX)
            return 1;
        land(st, p, res);
        return 0;
    }
    if (res == -ECANCELED && !fx_batch_stopped(st->b)) {
        /* Not a cancel of ours: the kernel had no io-wq worker for a piece
         * it could not finish inline and could not start one (a pids limit
         * with no task to spare). Resubmitting would meet the same; what is
         * left of the piece runs here, as the thread engine runs it. */
        int64_t r = fx_piece_run_sync(st->b, p);

        atomic_fetch_add(&fx_uring_sync_pieces, 1);
        land(st, p, r < 0 ? r : (int64_t)st->done[pi] + r);
        return 0;
    }
    if (res < 0) {
        land(st, p, res); /* a header with it fails the same way */
        return 0;
    }
    if (p->hdr) {
        /* A fused piece: its header first. */
        int fd = st->b->ops[p->op].fd;

        if (res < (int)FX_HDR_SIZE) {
            if (res == 0 || fx_hdr_at_eof(fd, p->offset - FX_HDR_SIZE, (uint64_t)res)) {
                fx_piece_header_done(st->b, p, res); /* the file ends inside its header */
                land(st, p, 0);
                return 0;
            }
            if (p->retries++ >= FX_RETRY_MAX) {
                land(st, p, -EIO);
                return 0;
            }
            return 1; /* the whole again */
        }
        fx_piece_header_done(st->b, p, FX_HDR_SIZE);
        res -= (int)FX_HDR_SIZE;
        if (res == 0 && p->length) {
            if (p->retries++ >= FX_RETRY_MAX) {
                land(st, p, -EIO);
                return 0;
            }
            return 1; /* the rest as a plain read */
        }
    }
    if (res == 0) {
        land(st, p, write ? -EIO : st->done[pi]); /* EOF */
        return 0;
    }
    if ((uint64_t)res >= p->length) {
        st->done[pi] += res;
        land(st, p, st->done[pi]);
        return 0;
    }
    if (write && p->direct) {
        land(st, p, -ENOSPC); /* short O_DIRECT write: out of space */
        return 0;
    }
    keep = fx_short_keep(write, p->direct, st->b->ops[p->op].fd, p->offset, (uint64_t)res);
    if (keep < 0) {
        st->done[pi] += res; /* O_DIRECT read that ended at EOF */
        land(st, p, st->done[pi]);
        return 0;
    }
    if (p->retries++ >= FX_RETRY_MAX) {
        land(st, p, -EIO);
        return 0;
    }
    st->done[pi] += keep;
    p->offset += (uint64_t)keep;
    p->buf += keep;
    p->length -= (uint64_t)keep;
    return 1;
}

/* A completion's result, through the fault points when they are armed. */
static int cqe_result(int write, int res)
{
    long k;

    if (__builtin_expect(fx_fault_on, 0)) {
        if (fx_fault_hit(FX_FAULT_EINTR))
            return -EINTR;
        if (fx_fault_hit(FX_FAULT_EAGAIN))
            return -EAGAIN;
        if (!write && res > 0 && (k = fx_fault_hit(FX_FAULT_SHORT)))
            return (int)fx_fault_short(res, k);
    }
    return res;
}

/* Landed bytes worth spreading over threads (below it, a hand-off costs
 * more than it saves). For tests, LMCACHE_FX_CRC_WIDTH overrides the width
 * and LMCACHE_FX_CRC_MIN the bytes (0: every landing, one piece included). */
#define CRC_PARALLEL_MIN (2u << 20)
static int crc_cap;
static uint64_t crc_min = CRC_PARALLEL_MIN;
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_setup(void)
{
    const char *w = getenv("LMCACHE_FX_CRC_WIDTH"), *m = getenv("LMCACHE_FX_CRC_MIN");
    int want = w && *w ? atoi(w) : 0;

    if (m && *m)
        crc_min = strtoull(m, NULL, 10);
    /* One CPU stays with the reaping thread, which waits meanwhile but must
     * wake to refill the ring. */
    crc_cap = want > 0 ? want : (int)iowq_workers() - 1;
}

static int crc_width(const fx_batch *b)
{
    pthread_once(&crc_once, crc_setup);
    return b->crc_width < crc_cap ? b->crc_width : crc_cap;
}

static void checksum_landed(void *ctx, size_t i)
{
    run_state *st = ctx;

    fx_piece_checksum(st->b, st->landed[i], st->landed_res[i]);
}

static void finish_landed(run_state *st)
{
    const fx_batch *b = st->b;
    int width = b->want_crc && b->crc_pool && st->nlanded ? crc_width(b) : 0;
    int summed = 0;

    if (width > 1 && (st->nlanded > 1 || crc_min == 0)) {
        uint64_t bytes = 0;

        for (unsigned i = 0; i < st->nlanded; i++)
            if (st->landed_res[i] > 0)
                bytes += (uint64_t)st->landed_res[i];
        if (bytes >= crc_min)
            summed = fx_pool_parallel(b->crc_pool, st->nlanded, checksum_landed, st, width) == 0;
        if (summed)
            fx_crc_spread_runs++;
    }
    for (unsigned i = 0; i < st->nlanded; i++)
        (summed ? piece_done : finish)(st, st->landed[i], st->landed_res[i]);
    st->nlanded = 0;
}

/* The ring failed: reap every piece the kernel still holds (one that came
 * back whole counts; the others fail with err), fail the pieces never
 * submitted, and throw the ring away rather than reuse it. */
static int abort_run(fx_uring *u, run_state *st, fx_ring *s, int err)
{
    finish_landed(st);
    s->queued = 0; /* never taken by the kernel: they die with the ring */
    while (fx_ring_inflight(s)) {
        fx_event ev;
        fx_piece *p;
        size_t pi;
        int res;

        if (fx_ring_getevents(s, &ev, 1, -1) <= 0)
            continue;
        p = ev.tag;
        res = cqe_result(st->b->write, ev.res);
        pi = (size_t)(p - st->b->pieces);
        if (p->hdr) {
            if (res >= 0 && (uint64_t)res >= FX_HDR_SIZE + p->length) {
                fx_piece_header_done(st->b, p, FX_HDR_SIZE);
                finish(st, p, (int64_t)p->length);
            } else {
                finish(st, p, res < 0 ? res : err);
            }
        } else if (res >= 0 && (uint64_t)res >= p->length)
            finish(st, p, st->done[pi] + res);
        else
            finish(st, p, res < 0 ? res : err);
    }
    give_slots(u, st, st->held);
    set_wanting(u, st, 0);
    fx_ring_discard(s);
    for (size_t i = 0; i < st->b->npieces; i++)
        if (!st->fin[i])
            finish(st, &st->b->pieces[i], err);
    return err;
}

/* Queues new pieces up to the queue depth; bounced pieces run inline. */
static void fill(fx_uring *u, fx_ring *s, run_state *st, size_t *next)
{
    fx_batch *b = st->b;

    while (*next < b->npieces && fx_ring_inflight(s) + fx_ring_queued(s) < u->qd) {
        fx_piece *p = &b->pieces[st->order ? st->order[*next] : *next];

        if (fx_batch_stopped(b)) { /* cancelled: the rest end unread */
            (*next)++;
            finish(st, p, -ECANCELED);
            continue;
        }
        if (fx_piece_needs_bounce(p)) {
            /* Rare (unaligned tail or buffer on O_DIRECT): done inline. */
            (*next)++;
            finish(st, p, fx_piece_run_sync(b, p));
            continue;
        }
        unsigned n = piece_slots(u, b, p); /* taken now, while length is the whole piece */
        int staged = stages(st, p);
        char *stage = NULL;

        /* A staged piece with no slot to be had waits until one of this
         * batch's own staged pieces is done, unless chunk writes share the
         * device. Their requests queue beside this batch's, so a batch
         * capped at its slots' worth in flight got 0.50-0.62x of reading in
         * place while a store ran (the bench's --mixed case); reading the
         * rest in place keeps its share. A batch holding none reads in
         * place. */
        int may_wait = st->staged_out && !fx_chunk_writes_running;

        if (staged && st->staged_out >= st->stage_max && may_wait)
            break;
        /* The engine's slots first: a batch waiting for them (its first
         * piece, in ticket order) holds no staging slot meanwhile. */
        if (!take_slot(u, st, n))
            break;
        if (fx_batch_stopped(b)) { /* cancelled while it waited its turn for a slot: nothing more read */
            give_slots(u, st, n);  /* the piece is done, unread */
            (*next)++;
            finish(st, p, -ECANCELED);
            continue;
        }
        if (staged && st->staged_out < st->stage_max)
            stage = stage_take();
        if (staged && !stage && may_wait) {
            untake_slot(u, st, n);
            break;
        }
        p->slots = n;
        if (stage) {
            p->stage = p->buf = stage;
            st->staged_out++;
        }
        if (queue_piece(u, s, b, p) < 0) {
            unstage(st, p);
            give_slots(u, st, n);
            break;
        }
        if (stage)
            fx_direct_staged_pieces++;
        {
            unsigned long out = fx_ring_inflight(s) + fx_ring_queued(s);
            unsigned long peak = atomic_load_explicit(&fx_uring_peak_inflight, memory_order_relaxed);

            while (out > peak && !atomic_compare_exchange_weak(&fx_uring_peak_inflight, &peak, out))
                ;
        }
        (*next)++;
    }
    if (*next == b->npieces)
        set_wanting(u, st, 0);
}

/* No ring to be had: the batch runs on this thread. */
static void run_inline(fx_batch *b)
{
    for (size_t i = 0; i < b->npieces; i++) {
        fx_piece *p = &b->pieces[i];
        int64_t r = fx_piece_run_sync(b, p);

        fx_piece_checksum(b, p, r);
        if (fx_piece_finish(b, p, r))
            fx_op_complete(b, p->op);
    }
}

int fx_uring_run(fx_uring *u, fx_batch *b)
{
    fx_ring *s;
    size_t next = 0;
    run_state st = {.b = b};
    fx_event *ev = NULL;
    int ret = 0, err;

    if (b->npieces == 0)
        return 0;
    if (FX_FORKED(u->gen)) {
        fx_batch_fail_all(b, EOWNERDEAD); /* the rings are the parent's */
        return -EOWNERDEAD;
    }
    s = fx_uring_take_ring(u);
    if (!s) {
        run_inline(b);
        return 0;
    }
    st.done = calloc(b->npieces, sizeof(*st.done));
    st.fin = calloc(b->npieces, 1);
    st.landed = calloc(u->qd, sizeof(*st.landed));
    st.landed_res = calloc(u->qd, sizeof(*st.landed_res));
    ev = calloc(u->qd, sizeof(*ev));
    if (!st.done || !st.fin || !st.landed || !st.landed_res || !ev) {
        fx_uring_give_ring(u, s);
        ret = -ENOMEM;
        goto out;
    }
    for (size_t i = 0; i < b->npieces; i++)
        st.left += piece_slots(u, b, &b->pieces[i]);
    st.stage_on = b->stage_direct && !b->write && b->want_crc;
    {
        unsigned ndevs;

        st.order = fx_piece_order(b, &ndevs);
        st.stage_max = STAGE_BATCH_MAX * (ndevs < STAGE_DEVICES_MAX ? ndevs : STAGE_DEVICES_MAX);
    }
    set_wanting(u, &st, 1);
    while (next < b->npieces || fx_ring_inflight(s) || fx_ring_queued(s)) {
        unsigned ended = 0;
        int n;

        fill(u, s, &st, &next);
        if (!fx_ring_inflight(s) && !fx_ring_queued(s))
            continue; /* the rest was bounced inline */
        if ((n = fx_ring_getevents(s, ev, u->qd, -1)) < 0) {
            ret = abort_run(u, &st, s, n);
            goto out;
        }
        for (int i = 0; i < n; i++) {
            fx_piece *p = ev[i].tag;

            if (!on_cqe(&st, p, cqe_result(b->write, ev[i].res))) {
                ended += p->slots;
                continue;
            }
            /* A resubmitted piece keeps its slots; inflight + queued stays
             * within the SQ size, so there is room. */
            if (queue_piece(u, s, b, p) < 0) {
                land(&st, p, -EBUSY);
                ended += p->slots;
            }
        }
        give_slots(u, &st, ended);
        if (st.nlanded) {
            /* Keep the device busy while this thread checksums what landed. */
            fill(u, s, &st, &next);
            if ((err = fx_ring_commit(s)) < 0) {
                ret = abort_run(u, &st, s, err);
                goto out;
            }
            finish_landed(&st);
        }
    }
    set_wanting(u, &st, 0);
    fx_uring_give_ring(u, s);
    fx_uring_last_end = st.ended_at;
out:
    free(st.order);
    free(st.done);
    free(st.fin);
    free(st.landed);
    free(st.landed_res);
    free(ev);
    return ret;
}

#else /* built without liburing: the thread engine only */

int fx_uring_available(void) { return 0; }
unsigned fx_stage_buffers(void) { return 0; }
unsigned fx_stage_prepare(unsigned devices)
{
    (void)devices;
    return 0;
}
fx_uring *fx_uring_create(unsigned qd, char *why, size_t whylen)
{
    (void)qd;
    snprintf(why, whylen, "lmcache-fx was built without liburing (install liburing-dev and rebuild)");
    return NULL;
}
void fx_uring_destroy(fx_uring *u) { (void)u; }
int fx_uring_run(fx_uring *u, fx_batch *b)
{
    (void)u;
    (void)b;
    return -ENOSYS;
}
int fx_uring_register(fx_uring *u, void *addr, size_t len)
{
    (void)u;
    (void)addr;
    (void)len;
    return -ENOSYS;
}
int fx_uring_registered(const fx_uring *u)
{
    (void)u;
    return 0;
}
int fx_uring_shares_registration(void) { return 0; }
fx_ring *fx_uring_take_ring(fx_uring *u)
{
    (void)u;
    return NULL;
}
int fx_uring_register_extra(fx_uring *u, void *addr, size_t len)
{
    (void)u;
    (void)addr;
    (void)len;
    return -ENOSYS;
}
void fx_uring_unregister_extra(fx_uring *u, int handle)
{
    (void)u;
    (void)handle;
}
int fx_ring_fixed_index(fx_uring *u, const fx_ring *s, const void *addr, uint64_t len)
{
    (void)u;
    (void)s;
    (void)addr;
    (void)len;
    return -1;
}
int fx_uring_give_ring(fx_uring *u, fx_ring *r)
{
    (void)u;
    (void)r;
    return -ENOSYS;
}
#endif
