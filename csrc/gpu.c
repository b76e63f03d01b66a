/* GPU staging and DMA without GDS.
 *
 * A GpuStaging object owns a staging pool: anonymous memory, 2 MiB-aligned with
 * MADV_HUGEPAGE (fx_mem_alloc), cut into slots, registered as io_uring fixed
 * buffers (a refusal is kept in fixed_error, and reads go on unregistered) and page-locked
 * through the GPU driver found at run time with dlopen (libcuda.so.1, or
 * ROCm's libamdhip64.so; LMCACHE_FX_GPU_DRIVER=/path/lib.so selects another
 * library exporting the CUDA driver names, e.g. the tests' stand-in). Binding
 * fills one function table (gpu_ops) for CUDA or HIP; every driver call goes
 * through it.
 *
 * read(ops) pipelines NVMe -> GPU: each op (fd, offset, length, device_ptr) is
 * cut into pieces of at most slot_bytes; a piece is read into a free slot; when
 * the read lands, an async host-to-device copy from the slot to its place in
 * GPU memory is put on the pool's stream and an event recorded after it, while
 * later reads go on. A slot is read into again only after its event completed.
 * With crc, each piece is checksummed in its slot (the copy only reads it) and
 * the CRCs combined per op. The first error stops new reads and copies
 * (cancel_on_error, the default; otherwise a read error ends only its op),
 * every read in flight is reaped -- whatever the waits return -- and every copy
 * waited for before the call returns. The GIL is released.
 *
 * Reads go through the C core's engine, not beside it: given an io_uring
 * Engine whose queue depth holds a read per slot (the plugin passes its
 * store's), a read takes one of the engine's rings for the run and drives it
 * with the core's queue / commit / getevents (fxio.h, ring.c), the slots registered as another
 * region of the rings' fixed-buffer table beside LMCache's pool; given a
 * thread Engine, its pool's threads do the reads (fx_tq). A pool made without
 * an engine (tools, tests), or with one too shallow for its slots, has a ring
 * or reader threads of its own, driven the same way.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "fxmodule.h"

#ifdef FX_HAVE_LIBURING
#include <liburing.h>
#endif


#include "gpu_driver.h"

/* ------------------------------------------------------------ the trace */

enum { T_READ_SUBMIT = 1, T_READ_DONE, T_COPY_ISSUE, T_COPY_DONE, T_ERROR };
static const char *trace_names[] = {"", "read_submit", "read_done", "copy_issue", "copy_done", "error"};

typedef struct {
    uint64_t t;
    int kind;
    int slot;
    int64_t op;
    int64_t piece;
    int64_t val; /* bytes, or -errno / driver code */
} trace_ev;

/* ------------------------------------------------------------- the slots */

enum { S_FREE = 0, S_READING, S_COPYING };

typedef struct {
    int state;
    int idx;
    size_t op;
    int64_t piece;
    int fd;
    int direct;
    uint64_t rd_off;  /* file offset of the read (block-aligned on O_DIRECT) */
    uint64_t rd_len;  /* bytes asked */
    uint64_t got;     /* bytes landed */
    uint64_t use_off; /* file offset of the first wanted byte in this piece */
    uint64_t use_len; /* wanted bytes in this piece */
    uint64_t copied;  /* wanted bytes being copied */
    int want_crc;     /* checksum the wanted bytes that landed */
    int crc_ready;    /* thread reader: crc / crc_len computed by the reader thread */
    uint32_t crc;
    uint64_t crc_len;
    uint64_t crc_ns;  /* time the reader thread spent on it */
    uint32_t retries; /* resubmissions (EINTR, EAGAIN, short reads), at most FX_RETRY_MAX */
} slot_t;

typedef struct {
    int fd;
    int direct;
    uint64_t off, len;
    unsigned long long dev;
    uint64_t ra, rb;   /* file range read: [ra, rb) */
    int err;           /* errno */
    int dropped;       /* a piece was thrown away by a cancel */
    int issued_all;
    int eof;
    uint32_t outstanding;
    uint64_t bytes;
    uint32_t crc; /* CRC32C of the bytes copied, when asked for */
} op_t;

/* --------------------------------------------------------- the thread reader */

/* Wanted bytes of a piece once got bytes landed: [use_off, use_off + n). */
static uint64_t landed_use(const slot_t *s, uint64_t got)
{
    uint64_t have_end = s->rd_off + got, ue = s->use_off + s->use_len;
    if (have_end < ue)
        ue = have_end;
    return ue > s->use_off ? ue - s->use_off : 0;
}

typedef struct GpuStagingObject GpuStagingObject;
static char *slot_addr(GpuStagingObject *g, int i);

/* Thread reader: after a piece's pread, on the pool thread that did it, its
 * CRC -- in parallel, rather than on the pipeline's thread. */
static void tq_crc(void *actx, void *tag, int64_t res)
{
    GpuStagingObject *g = actx;
    slot_t *s = tag;

    if (res > 0) {
        uint64_t t0 = fx_now_ns();
        s->crc_len = landed_use(s, (uint64_t)res);
        s->crc = fx_crc32c(0, slot_addr(g, s->idx) + (s->use_off - s->rd_off), s->crc_len);
        s->crc_ready = 1;
        s->crc_ns = fx_now_ns() - t0;
    }
}

/* ------------------------------------------------------------ the object */

struct GpuStagingObject {
    PyObject_HEAD
    pthread_mutex_t run_mu; /* one read() at a time */
    int ready, closed;
    int initialising; /* __init__ is running (it drops the GIL): a second call is refused */
    int device;
    int cudev; /* CUdevice handle (what the primary context is retained and released with) */
    void *ctx;
    char *mem;
    size_t mapped;
    size_t slot_bytes;
    unsigned nslots;
    int pinned;
    char pin_error[256];
    void *stream;
    void **events;
    void *ev_in;  /* recorded on the caller's stream; the pipeline stream waits on it */
    void *ev_out; /* recorded after the last copy; the caller's stream waits on it */
    int pending;  /* a read(sync=False) left copies out of the slots in flight */
    char close_warning[512]; /* what close() found wrong, given as one RuntimeWarning ("" if nothing) */
    int io; /* 1 io_uring, 0 threads */
    int fixed;
    char fixed_error[256]; /* why the slots are not io_uring fixed buffers (io_uring only) */
    char io_error[256];    /* why reads run on threads where io_uring was asked for, or "" */
    int numa_node;         /* node the staging memory was bound to, or -1 */
    char numa_info[256];
    pid_t pid;             /* process that built the pool */
    unsigned gen;          /* fx_fork_gen when it was built: a fork()ed child sees another */
    int have_ctx;          /* the device context is held (CUDA: primary context retained) */
    fx_ring *ring; /* the ring reads go to: the pool's own, or an engine's while a read runs */
    PyObject *engine; /* io_uring Engine whose rings the reads use (a reference), or NULL */
    fx_uring *eu;     /* its io_uring */
    int reg_handle;   /* the slots' region in the engine's fixed-buffer table, or 0 */
    int broken; /* the ring failed with reads still queued: unusable */
    fx_pool *pool; /* thread reader: a thread engine's pool (borrowed), or one of its own */
    int own_pool;
    fx_tq *tq;     /* submit / reap on it */
    unsigned poll_us;
    /* last run */
    char last_error[512]; /* the run's, written under run_mu */
    /* last_error of the last read() to end, for the last_error attribute:
     * copied under run_mu, read under err_mu only (a getter must not wait
     * for a running read; it read last_error while the next read wrote it) */
    pthread_mutex_t err_mu;
    char shown_error[512];
    trace_ev *trace;
    size_t ntrace, trace_cap;
    int tracing;
    uint64_t st_wall_ns, st_bytes, st_reads, st_copies, st_overlap_copies, st_max_reads, st_copy_waits;
    uint64_t st_crc_ns, st_crc_bytes; /* checksumming, reader threads' time included */
};

static char *slot_addr(GpuStagingObject *g, int i) { return g->mem + (size_t)i * g->slot_bytes; }

static PyTypeObject GpuStagingType;

static void tr_add(GpuStagingObject *g, int kind, int slot, int64_t op, int64_t piece, int64_t val)
{
    if (!g->tracing)
        return;
    if (g->ntrace == g->trace_cap) {
        size_t cap = g->trace_cap ? g->trace_cap * 2 : 1024;
        trace_ev *t = realloc(g->trace, cap * sizeof(*t));
        if (!t)
            return;
        g->trace = t;
        g->trace_cap = cap;
    }
    g->trace[g->ntrace++] = (trace_ev){fx_now_ns(), kind, slot, op, piece, val};
}

static void set_error(GpuStagingObject *g, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_error(GpuStagingObject *g, const char *fmt, ...)
{
    va_list ap;
    if (g->last_error[0])
        return; /* keep the first */
    va_start(ap, fmt);
    vsnprintf(g->last_error, sizeof(g->last_error), fmt, ap);
    va_end(ap);
}

/* A read(sync=False) left copies in flight: wait for them before the slots
 * are touched. -1 when one of them failed (last_error says so): that read's
 * results counted bytes the GPU never got, so its caller must be told. */
static int settle_pending(GpuStagingObject *g)
{
    char why[256];
    int r;

    if (!g->pending)
        return 0;
    r = fx_gpu_driver.ops->stream_sync(g->stream);
    g->pending = 0;
    if (r == 0)
        return 0;
    snprintf(why, sizeof(why), "a copy queued by the last read(sync=False) failed: %s (%d); its data is not in GPU memory",
             fx_gpu_errname(r), r);
    set_error(g, "%s", why);
    if (g->closed)
        snprintf(g->close_warning, sizeof(g->close_warning), "%s", why);
    return -1;
}

/* Tears down whatever was built; safe on a half-built object. */
static void staging_free(GpuStagingObject *g)
{
    saved_ctx sc;
    int keep_mem = 0;

    if (fx_tq_free(g->tq) == 0) /* every read was reaped by then */
        g->tq = NULL;
    if (g->own_pool)
        fx_pool_destroy(g->pool);
    g->pool = NULL;
    g->own_pool = 0;
    fx_ring_discard(g->ring); /* drops the fixed buffers too; every read was reaped */
    g->ring = NULL;
    if (g->reg_handle && g->engine && fx_engine_hold(g->engine) == 0) {
        fx_uring_unregister_extra(g->eu, g->reg_handle); /* else the engine is closed: nothing left */
        fx_engine_end(g->engine);
    }
    g->reg_handle = 0;
    if (fx_gpu_driver.ops && g->have_ctx && (g->stream || g->events || g->pinned || g->ev_in || g->ev_out)) {
        const gpu_ops *d = fx_gpu_driver.ops;
        int r = d->ctx_enter(g->ctx, g->device, &sc);
        if (r != 0) {
            /* Nothing context-bound can be released without the context, and
             * the staging memory may still be pinned or read by queued copies:
             * it stays mapped (freed, the DMA would read freed pages, and a
             * later mapping at its address could not be pinned). */
            keep_mem = g->mem != NULL;
            snprintf(g->close_warning, sizeof(g->close_warning),
                     "GpuStaging.close: the GPU context of device %d could not be made current: %s (%d); its stream, "
                     "events and pinned staging memory (%zu MiB, kept mapped) are not released",
                     g->device, fx_gpu_errname(r), r, g->mapped >> 20);
            goto no_context;
        }
        if (g->pending)
            (void)settle_pending(g); /* the copies a read(sync=False) left in flight */
        else if (g->stream)
            d->stream_sync(g->stream);
        if (g->events) {
            for (unsigned i = 0; i < g->nslots; i++)
                if (g->events[i])
                    d->event_destroy(g->events[i]);
        }
        if (g->ev_in)
            d->event_destroy(g->ev_in);
        if (g->ev_out)
            d->event_destroy(g->ev_out);
        g->ev_in = g->ev_out = NULL;
        if (g->stream)
            d->stream_destroy(g->stream);
        if (g->pinned)
            d->host_unregister(g->mem);
        d->ctx_leave(&sc);
    }
no_context:
    free(g->events);
    g->events = NULL;
    g->stream = NULL;
    g->pinned = 0;
    if (g->have_ctx && fx_gpu_driver.ops)
        fx_gpu_driver.ops->ctx_release(g->cudev); /* the device handle, as retained */
    g->have_ctx = 0;
    g->ctx = NULL;
    if (g->mem && !keep_mem) {
        fx_mem m = {.addr = g->mem, .mapped = g->mapped};
        fx_mem_free(&m);
    }
    g->mem = NULL;
}

/* ------------------------------------------------------------- NUMA */

/* NUMA node of a PCI device from sysfs (<sysfs>/bus/pci/devices/<id>/numa_node),
 * the bus id as drivers give it ("0000:3B:00.0", any case, 4- or 8-digit
 * domain); -1 when unknown (no such file, or the kernel says -1). */
static int numa_node_of(const char *bus_id, const char *sysfs)
{
    unsigned dom, bus, dev, fn;
    char path[640], buf[32];
    int fd, node = -1;
    ssize_t n;

    if (sscanf(bus_id, "%x:%x:%x.%x", &dom, &bus, &dev, &fn) != 4)
        return -1;
    snprintf(path, sizeof(path), "%s/bus/pci/devices/%04x:%02x:%02x.%x/numa_node", sysfs, dom & 0xffff, bus, dev,
             fn);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n > 0) {
        buf[n] = 0;
        node = atoi(buf);
    }
    return node >= 0 && node < 1024 ? node : -1;
}

/* The GPU's NUMA node, or -1 (numa_info says why); the staging memory is
 * bound there, preferred (pages come from elsewhere rather than failing when
 * the node is full), before its pages are faulted in. */
static int numa_pick(GpuStagingObject *g, const char *sysfs, char *bus, size_t buslen)
{
    int r, node;

    r = fx_gpu_driver.ops->pci_bus_id(bus, (int)buslen, g->cudev, g->device);
    if (r != 0 || !bus[0]) {
        snprintf(g->numa_info, sizeof(g->numa_info), "GPU %d: PCI bus id unknown (%s): staging not placed",
                 g->device, r == -1 ? "driver has no DeviceGetPCIBusId" : fx_gpu_errname(r));
        return -1;
    }
    bus[buslen - 1] = 0;
    node = numa_node_of(bus, sysfs);
    if (node < 0)
        snprintf(g->numa_info, sizeof(g->numa_info), "GPU %d (%s): no NUMA node in %s: staging not placed",
                 g->device, bus, sysfs);
    return node;
}

/* Builds the pool without the GIL; 0 or -1 with msg. */
static int staging_build(GpuStagingObject *g, int want_uring, const char *sysfs, char *msg, size_t msglen)
{
    size_t total = (size_t)g->nslots * g->slot_bytes;
    saved_ctx sc;
    int r;

    g->numa_node = -1;
    {
        int dev = 0;
        if ((r = fx_gpu_driver.ops->device_get(g->device, &dev)) != 0) {
            snprintf(msg, msglen, "device %d: %s (%d)", g->device, fx_gpu_errname(r), r);
            return -1;
        }
        g->cudev = dev;
    }
    /* Staging memory: 2 MiB-aligned anonymous, huge pages asked for, on the
     * GPU's NUMA node, faulted in before pinning; MADV_DONTFORK: a fork()ed
     * child gets no copy (the pool is unusable there anyway, see
     * fx_gpu_atfork_child) and the parent's pinned pages stay its own. */
    {
        char bus[64] = "";
        int node = numa_pick(g, sysfs, bus, sizeof(bus));
        fx_mem m;

        if ((r = fx_mem_alloc(&m, total, 1, node, 1)) < 0) {
            snprintf(msg, msglen, "mmap of %zu bytes failed: %s", total, strerror(-r));
            return -1;
        }
        g->mem = m.addr;
        g->mapped = m.mapped;
        g->numa_node = m.numa_node;
        if (node >= 0 && m.numa_node < 0)
            snprintf(g->numa_info, sizeof(g->numa_info), "GPU %d (%s) is on node %d; mbind failed: %s", g->device,
                     bus, node, strerror(m.numa_err));
        else if (node >= 0)
            snprintf(g->numa_info, sizeof(g->numa_info), "GPU %d (%s) is on node %d: staging placed there",
                     g->device, bus, node);
    }

    /* Driver: context, page-locking, stream, one event per slot. */
    if ((r = fx_gpu_driver.ops->ctx_retain(g->cudev, &g->ctx)) != 0) {
        g->ctx = NULL;
        snprintf(msg, msglen, "device %d: %s (%d)", g->device, fx_gpu_errname(r), r);
        return -1;
    }
    g->have_ctx = 1;
    if ((r = fx_gpu_driver.ops->ctx_enter(g->ctx, g->device, &sc)) != 0) {
        snprintf(msg, msglen, "cannot make device %d current: %s (%d)", g->device, fx_gpu_errname(r), r);
        return -1;
    }
    r = fx_gpu_driver.ops->host_register(g->mem, g->mapped);
    if (r == 0)
        g->pinned = 1;
    else /* copies still work, but synchronously: no overlap */
        snprintf(g->pin_error, sizeof(g->pin_error), "host register failed: %s (%d)", fx_gpu_errname(r), r);
    r = fx_gpu_driver.ops->stream_create(&g->stream);
    if (r != 0) {
        g->stream = NULL;
        fx_gpu_driver.ops->ctx_leave(&sc);
        snprintf(msg, msglen, "stream create failed: %s (%d)", fx_gpu_errname(r), r);
        return -1;
    }
    g->events = calloc(g->nslots, sizeof(*g->events));
    if (!g->events) {
        fx_gpu_driver.ops->ctx_leave(&sc);
        snprintf(msg, msglen, "out of memory");
        return -1;
    }
    for (unsigned i = 0; i < g->nslots + 2; i++) {
        void **ev = i < g->nslots ? &g->events[i] : i == g->nslots ? &g->ev_in : &g->ev_out;
        r = fx_gpu_driver.ops->event_create(ev);
        if (r != 0) {
            *ev = NULL;
            fx_gpu_driver.ops->ctx_leave(&sc);
            snprintf(msg, msglen, "event create failed: %s (%d)", fx_gpu_errname(r), r);
            return -1;
        }
    }
    fx_gpu_driver.ops->ctx_leave(&sc);

    /* Reads: the engine's rings, else the pool's own ring, the slots as fixed
     * buffers on either; else threads (the engine's pool, or one of its own). */
#ifdef FX_HAVE_LIBURING
    if (want_uring && g->eu) {
        /* The engine's rings, taken per read; the slots as another region of
         * their fixed-buffer table, else plain reads. */
        g->io = 1;
        r = fx_uring_register_extra(g->eu, g->mem, g->mapped);
        g->fixed = r > 0;
        g->reg_handle = r > 0 ? r : 0;
        if (r < 0)
            snprintf(g->fixed_error, sizeof(g->fixed_error), "io_uring fixed-buffer registration failed: %s%s",
                     strerror(-r),
                     r == -ENOSPC                 ? " (every registration slot of the engine's rings is taken)"
                     : r == -ENOMEM || r == -EPERM ? " (RLIMIT_MEMLOCK too low without CAP_IPC_LOCK?)"
                     : r == -EOPNOTSUPP            ? " (too large to pin on every ring, on a kernel before 6.12 that "
                                                     "cannot share one registration among rings)"
                                                   : "");
    } else if (want_uring) {
        g->ring = fx_ring_new(g->nslots + 2, 0, &r);
        if (!g->ring)
            snprintf(g->io_error, sizeof(g->io_error), "io_uring ring for the staging slots: %s", strerror(-r));
        else if ((r = fx_ring_works(g->ring)) < 0) {
            /* io_uring_enter refused (a seccomp profile allowing only the setup): the reader threads. */
            snprintf(g->io_error, sizeof(g->io_error), "io_uring_enter on the staging slots' ring failed: %s",
                     strerror(-r));
            fx_ring_discard(g->ring);
            g->ring = NULL;
        }
        if (g->ring) {
            struct iovec *iov = calloc(g->nslots, sizeof(*iov));
            g->io = 1;
            if (iov) {
                for (unsigned i = 0; i < g->nslots; i++) {
                    iov[i].iov_base = slot_addr(g, (int)i);
                    iov[i].iov_len = g->slot_bytes;
                }
                /* Refused without CAP_IPC_LOCK above RLIMIT_MEMLOCK: plain reads then. */
                r = fx_ring_register_buffers(g->ring, iov, g->nslots);
                g->fixed = r == 0;
                if (r < 0)
                    snprintf(g->fixed_error, sizeof(g->fixed_error),
                             "io_uring fixed-buffer registration failed: %s%s", strerror(-r),
                             r == -ENOMEM || r == -EPERM ? " (RLIMIT_MEMLOCK too low without CAP_IPC_LOCK?)"
                                                         : "");
                free(iov);
            }
        }
    }
#else
    (void)want_uring;
#endif
    if (!g->io) {
        int n = g->nslots < 8 ? (int)g->nslots : 8;
        if (!g->pool) /* no thread engine to borrow from */
            g->own_pool = (g->pool = fx_pool_create(n)) != NULL;
        if (!g->pool || !(g->tq = fx_tq_new(g->pool, g->nslots, n))) {
            snprintf(msg, msglen, g->pool ? "out of memory" : "could not start reader threads");
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------- the run */

typedef struct {
    GpuStagingObject *g;
    op_t *ops;
    size_t nops;
    size_t cur;      /* op the cursor is on */
    uint64_t pos;    /* next read offset within cur */
    int cur_started;
    int cancel;
    int cancel_on_error;
    int64_t npieces;
    slot_t *slots;
    int *fifo; /* copying slots in issue order */
    unsigned fh, fn;
    unsigned reading, copying;
    /* CRC32C per piece (pieces are numbered in file order within an op and
     * an op's pieces are consecutive), combined per op at the end */
    int want_crc;
    struct piece_crc {
        size_t op;
        uint64_t len;
        uint32_t crc;
    } *pcrc;
    size_t pcap;
} run_t;

static int op_fail(run_t *R, size_t i, int err, int cancel_all)
{
    if (!R->ops[i].err)
        R->ops[i].err = err;
    if (cancel_all || R->cancel_on_error)
        R->cancel = 1;
    return 0;
}

/* Moves the cursor to the next piece to read; 0 when none is left. */
static int next_piece(run_t *R)
{
    while (R->cur < R->nops) {
        op_t *o = &R->ops[R->cur];
        if (R->cancel)
            return 0;
        if (!R->cur_started) {
            struct stat st;
            int fl;
            R->cur_started = 1;
            if (o->len == 0) {
                o->issued_all = 1;
                goto advance;
            }
            fl = fcntl(o->fd, F_GETFL);
            if (fl < 0 || fstat(o->fd, &st) < 0) {
                o->issued_all = 1;
                op_fail(R, R->cur, errno, 0);
                set_error(R->g, "op %zu: fd %d: %s", R->cur, o->fd, strerror(errno));
                goto advance;
            }
            if (!(S_ISREG(st.st_mode) || S_ISBLK(st.st_mode))) {
                int e = S_ISDIR(st.st_mode) ? EISDIR : ESPIPE;
                o->issued_all = 1;
                op_fail(R, R->cur, e, 0);
                set_error(R->g, "op %zu: fd %d: %s", R->cur, o->fd, strerror(e));
                goto advance;
            }
            o->direct = (fl & O_DIRECT) != 0;
            o->ra = o->direct ? o->off & ~(uint64_t)(FX_DIO_ALIGN - 1) : o->off;
            o->rb = o->direct ? (o->off + o->len + FX_DIO_ALIGN - 1) & ~(uint64_t)(FX_DIO_ALIGN - 1)
                              : o->off + o->len;
            R->pos = o->ra;
        }
        if (!o->err && !o->eof && R->pos < o->rb)
            return 1;
        o->issued_all = 1;
    advance:
        R->cur++;
        R->cur_started = 0;
    }
    return 0;
}

/* The fixed-buffer index a read into buf uses, or -1 for a plain read. */
static int slot_fixed(GpuStagingObject *g, const slot_t *s, const char *buf, uint64_t len)
{
    if (!g->fixed)
        return -1;
    if (g->eu)
        return fx_ring_fixed_index(g->eu, g->ring, buf, len);
    return s->idx;
}

static void slot_done(run_t *R, slot_t *s);

static int start_read(run_t *R, slot_t *s)
{
    GpuStagingObject *g = R->g;
    op_t *o = &R->ops[R->cur];
    uint64_t end = R->pos + g->slot_bytes < o->rb ? R->pos + g->slot_bytes : o->rb;
    uint64_t ue = o->off + o->len;
    int r;

    if (R->want_crc && (size_t)R->npieces >= R->pcap) {
        size_t cap = R->pcap ? R->pcap * 2 : 256;
        struct piece_crc *p = realloc(R->pcrc, cap * sizeof(*p));
        if (!p) {
            o->issued_all = 1;
            op_fail(R, R->cur, ENOMEM, 1);
            set_error(g, "op %zu: out of memory for its checksums", R->cur);
            return -ENOMEM;
        }
        R->pcrc = p;
        R->pcap = cap;
    }
    if (R->want_crc)
        R->pcrc[R->npieces] = (struct piece_crc){R->cur, 0, 0};
    s->state = S_READING;
    s->op = R->cur;
    s->piece = R->npieces++;
    s->fd = o->fd;
    s->direct = o->direct;
    s->rd_off = R->pos;
    s->rd_len = end - R->pos;
    s->got = 0;
    s->use_off = R->pos > o->off ? R->pos : o->off;
    s->use_len = (end < ue ? end : ue) - s->use_off;
    s->copied = 0;
    s->want_crc = R->want_crc;
    s->crc_ready = 0;
    s->crc_ns = 0;
    s->retries = 0;
    o->outstanding++;
    R->pos = end;
    R->reading++;
    g->st_reads++;
    if (R->reading > g->st_max_reads)
        g->st_max_reads = R->reading;
    tr_add(g, T_READ_SUBMIT, s->idx, (int64_t)s->op, s->piece, (int64_t)s->rd_len);
#ifdef FX_HAVE_LIBURING
    if (g->io) {
        fx_io io = {.fd = s->fd, .buf = slot_addr(g, s->idx), .len = s->rd_len, .off = s->rd_off, .tag = s};
        io.fixed = slot_fixed(g, s, io.buf, io.len);
        r = fx_ring_queue(g->ring, &io); /* room: the ring holds at least nslots */
    } else
#endif
    {
        fx_io io = {.fd = s->fd, .buf = slot_addr(g, s->idx), .len = s->rd_len, .off = s->rd_off,
                    .fixed = -1, .direct = s->direct, .tag = s};
        r = fx_tq_queue(g->tq, &io, s->want_crc ? tq_crc : NULL, g);
    }
    if (r < 0) {
        /* Not in flight: counted as reading, it would be waited for forever. */
        R->reading--;
        slot_done(R, s);
        op_fail(R, s->op, -r, 1);
        set_error(g, "op %zu: queueing a read failed: %s", s->op, strerror(-r));
    }
    return r;
}

#ifdef FX_HAVE_LIBURING
static void resubmit_rest(run_t *R, slot_t *s)
{
    GpuStagingObject *g = R->g;
    fx_io io = {.fd = s->fd, .buf = slot_addr(g, s->idx) + s->got, .len = s->rd_len - s->got,
                .off = s->rd_off + s->got, .tag = s};
    io.fixed = slot_fixed(g, s, io.buf, io.len);
    (void)fx_ring_queue(g->ring, &io); /* the slot's own entry came back: there is room */
}
#endif

static void slot_done(run_t *R, slot_t *s)
{
    op_t *o = &R->ops[s->op];
    s->state = S_FREE;
    o->outstanding--;
}

/* A read finished with res (total bytes, or -errno): copy what was wanted. */
static void read_landed(run_t *R, slot_t *s, int64_t res)
{
    GpuStagingObject *g = R->g;
    op_t *o = &R->ops[s->op];
    const char *src, *what;
    int r;

    R->reading--;
    tr_add(g, T_READ_DONE, s->idx, (int64_t)s->op, s->piece, res);
    if (res < 0) {
        op_fail(R, s->op, (int)-res, 0);
        set_error(g, "op %zu: read at offset %llu failed: %s", s->op, (unsigned long long)s->rd_off,
                  strerror((int)-res));
        tr_add(g, T_ERROR, s->idx, (int64_t)s->op, s->piece, res);
        slot_done(R, s);
        return;
    }
    if (R->cancel || o->err) {
        o->dropped = 1;
        slot_done(R, s);
        return;
    }
    s->got = (uint64_t)res;
    if (s->got < s->rd_len)
        o->eof = 1;
    s->copied = landed_use(s, s->got);
    if (!s->copied) {
        slot_done(R, s); /* nothing wanted landed (EOF) */
        return;
    }
    src = slot_addr(g, s->idx) + (s->use_off - s->rd_off);
    /* Traced before the call: the copy may start before it returns. */
    tr_add(g, T_COPY_ISSUE, s->idx, (int64_t)s->op, s->piece, (int64_t)s->copied);
    r = fx_gpu_driver.ops->copy_htod(o->dev + (s->use_off - o->off), src, s->copied, g->stream);
    what = fx_gpu_driver.ops->copy_name;
    if (r == 0) {
        r = fx_gpu_driver.ops->event_record(g->events[s->idx], g->stream);
        if (r != 0) {
            /* The copy is queued but has no event to judge it by: wait for
             * the stream, and fail the op (a miss, never a guess). */
            fx_gpu_driver.ops->stream_sync(g->stream);
            what = "recording the event after its copy";
        }
    }
    if (r != 0) {
        op_fail(R, s->op, EIO, 1);
        set_error(g, "op %zu: %s failed: %s (%d)", s->op, what, fx_gpu_errname(r), r);
        tr_add(g, T_ERROR, s->idx, (int64_t)s->op, s->piece, -r);
        slot_done(R, s);
        return;
    }
    if (R->want_crc) {
        /* The slot is ours until the copy's event completes and the copy only
         * reads it: its CRC is the CRC of the bytes the GPU receives. Computed
         * while the copy runs (a reader thread did it already, in parallel). */
        struct piece_crc *pc = &R->pcrc[s->piece];
        pc->len = s->copied;
        if (s->crc_ready && s->crc_len == s->copied) {
            pc->crc = s->crc;
            g->st_crc_ns += s->crc_ns;
        } else {
            uint64_t t0 = fx_now_ns();
            pc->crc = fx_crc32c(0, src, s->copied);
            g->st_crc_ns += fx_now_ns() - t0;
        }
        g->st_crc_bytes += s->copied;
    }
    g->st_copies++;
    if (R->reading)
        g->st_overlap_copies++;
    s->state = S_COPYING;
    R->fifo[(R->fh + R->fn) % g->nslots] = s->idx;
    R->fn++;
    R->copying++;
}

/* The copy from the oldest copying slot ended with driver status r. */
static void copy_finished(run_t *R, int r)
{
    GpuStagingObject *g = R->g;
    slot_t *s = &R->slots[R->fifo[R->fh]];
    op_t *o = &R->ops[s->op];

    R->fh = (R->fh + 1) % g->nslots;
    R->fn--;
    R->copying--;
    if (r == 0) {
        o->bytes += s->copied;
        g->st_bytes += s->copied;
        tr_add(g, T_COPY_DONE, s->idx, (int64_t)s->op, s->piece, (int64_t)s->copied);
    } else {
        op_fail(R, s->op, EIO, 1);
        set_error(g, "op %zu: copy to the GPU failed: %s (%d)", s->op, fx_gpu_errname(r), r);
        tr_add(g, T_ERROR, s->idx, (int64_t)s->op, s->piece, -r);
    }
    slot_done(R, s);
}

/* Reclaims slots whose copies completed; blocking waits for the oldest. */
static void reap_copies(run_t *R, int block)
{
    while (R->fn) {
        void *ev = R->g->events[R->fifo[R->fh]];
        int r = fx_gpu_driver.ops->event_query(ev);
        if (r == NOT_READY) {
            if (!block)
                return;
            R->g->st_copy_waits++;
            r = fx_gpu_driver.ops->event_sync(ev);
            block = 0;
        }
        copy_finished(R, r);
    }
}

/* Waits for read completions (timeout_us < 0: until one) and handles them.
 * A wait that fails is not a failed ring -- reads are still in flight, so the
 * loop keeps reaping; returns -errno only when submitting failed. */
static int wait_reads(run_t *R, long timeout_us)
{
    GpuStagingObject *g = R->g;
#ifdef FX_HAVE_LIBURING
    if (g->io) {
        fx_event ev[64];
        int n = fx_ring_getevents(g->ring, ev, 64, timeout_us); /* commits; the retry ladder inside */

        if (n < 0)
            return n; /* submitting failed */
        for (int i = 0; i < n; i++) {
            slot_t *s = ev[i].tag;
            int res = ev[i].res;
            if (__builtin_expect(fx_fault_on, 0) && res > 0) {
                long k;
                if (fx_fault_hit(FX_FAULT_EINTR))
                    res = -EINTR; /* tests: the read is done again */
                else if (fx_fault_hit(FX_FAULT_EAGAIN))
                    res = -EAGAIN;
                else if ((k = fx_fault_hit(FX_FAULT_SHORT)))
                    res = (int)fx_fault_short(res, k);
            }
            if (res == -EAGAIN || res == -EINTR) {
                if (s->retries++ < FX_RETRY_MAX) {
                    resubmit_rest(R, s);
                    continue;
                }
            } else if (res > 0) {
                uint64_t want = s->rd_len - s->got;
                if ((uint64_t)res < want) {
                    /* Short: go on from where it stopped (O_DIRECT: from the
                     * last whole block), unless the file ended there. */
                    int64_t keep = fx_short_keep(0, s->direct, s->fd, s->rd_off + s->got, (uint64_t)res);
                    if (keep >= 0) {
                        s->got += (uint64_t)keep;
                        if (s->retries++ < FX_RETRY_MAX) {
                            resubmit_rest(R, s);
                            continue;
                        }
                        read_landed(R, s, -EIO);
                        continue;
                    }
                }
                s->got += (uint64_t)res;
                res = (int)s->got;
            } else if (res == 0) {
                res = (int)s->got; /* EOF */
            }
            read_landed(R, s, res);
        }
        return 0;
    }
#endif
    {
        fx_event ev[64];
        int n = fx_tq_getevents(g->tq, ev, 64, timeout_us);

        for (int i = 0; i < n; i++)
            read_landed(R, ev[i].tag, ev[i].res);
        return 0;
    }
}

/* Runs the whole pipeline; no GIL. Fills res[] per op, and crcs[] (CRC32C of
 * the bytes copied) when given. -1 (nothing of this read done) when copies the
 * last read(sync=False) queued failed; else 0. */
static int run_pipeline(GpuStagingObject *g, op_t *ops, size_t nops, int64_t *res, uint32_t *crcs,
                         int cancel_on_error, void *cstream, int sync)
{
    run_t R = {.g = g, .ops = ops, .nops = nops, .cancel_on_error = cancel_on_error, .want_crc = crcs != NULL};
    saved_ctx sc;
    uint64_t t0 = fx_now_ns();
    int r, ret = 0;

    g->last_error[0] = 0;
    g->ntrace = 0;
    g->st_bytes = g->st_reads = g->st_copies = g->st_overlap_copies = g->st_max_reads = g->st_copy_waits = 0;
    g->st_crc_ns = g->st_crc_bytes = 0;
    R.slots = calloc(g->nslots, sizeof(*R.slots));
    R.fifo = calloc(g->nslots, sizeof(*R.fifo));
    if (!R.slots || !R.fifo) {
        for (size_t i = 0; i < nops; i++)
            res[i] = -ENOMEM;
        goto out;
    }
    for (unsigned i = 0; i < g->nslots; i++)
        R.slots[i].idx = (int)i;
    if ((r = fx_gpu_driver.ops->ctx_enter(g->ctx, g->device, &sc)) != 0) {
        set_error(g, "cannot make device %d current: %s (%d)", g->device, fx_gpu_errname(r), r);
        for (size_t i = 0; i < nops; i++)
            res[i] = -EIO;
        goto out;
    }
    if (settle_pending(g) < 0) {
        for (size_t i = 0; i < nops; i++)
            res[i] = -ECANCELED;
        fx_gpu_driver.ops->ctx_leave(&sc);
        ret = -1;
        goto out;
    }
    /* Stream order: no copy may start before the work the caller queued on
     * its stream so far (kernels still using the destination). */
    if ((r = fx_gpu_driver.ops->event_record(g->ev_in, cstream)) != 0 || (r = fx_gpu_driver.ops->stream_wait(g->stream, g->ev_in)) != 0) {
        set_error(g, "ordering after the caller's stream failed: %s (%s, %d)", fx_gpu_driver.ops->order_name, fx_gpu_errname(r),
                  r);
        for (size_t i = 0; i < nops; i++)
            res[i] = -EIO;
        fx_gpu_driver.ops->ctx_leave(&sc);
        goto out;
    }
    for (;;) {
        /* Slots whose copies ended are free again. */
        reap_copies(&R, 0);
        /* Fill free slots with reads. */
        for (unsigned i = 0; i < g->nslots && !R.cancel; i++) {
            if (R.slots[i].state != S_FREE)
                continue;
            if (!next_piece(&R))
                break;
            if (start_read(&R, &R.slots[i]) < 0)
                break;
        }
        if (!R.reading && !R.copying) {
            if (R.cancel || !next_piece(&R))
                break;
            continue;
        }
        /* sync=False: every read landed and its copy is queued: the caller's
         * stream waits for the last copies instead of this thread. */
        if (!sync && !R.reading && !R.cancel && !next_piece(&R))
            break;
        if (R.reading) {
            /* Poll copies while reads are out only when slots are wanted. */
            int more = !R.cancel && R.cur < nops;
            if ((r = wait_reads(&R, R.copying && more ? (long)g->poll_us : -1)) < 0) {
                /* Submitting failed: reap every read the kernel holds (they
                 * land in the slots), then stop. */
                set_error(g, "io_uring failed: %s", strerror(-r));
                R.cancel = 1;
                for (size_t i = 0; i < nops; i++)
                    if (!ops[i].issued_all || ops[i].outstanding)
                        op_fail(&R, i, -r, 1);
#ifdef FX_HAVE_LIBURING
                if (g->io) {
                    unsigned q = fx_ring_unqueue(g->ring);
                    if (q)
                        g->broken = 1; /* unsubmitted SQEs stay in the ring */
                    R.reading -= q;
                    while (R.reading) {
                        fx_event ev;
                        if (fx_ring_getevents(g->ring, &ev, 1, -1) > 0)
                            read_landed(&R, ev.tag, ev.res < 0 ? ev.res : r);
                    }
                }
#endif
            }
        } else {
            reap_copies(&R, 1); /* only copies out: wait for the oldest */
        }
    }
    if (R.copying) {
        /* sync=False: the caller's stream is ordered after the copies first.
         * Only then may copies still running count as done (queued): the
         * next read (or close) waits for them before it touches the slots
         * and reports one that failed. Where the order cannot be set (after
         * a GPU fault every later call returns the fault), each copy is
         * judged here by its event, as with sync=True: counted as done
         * first, a failed copy's bytes were reported, with the CRC of the
         * staging slot, and no later call said otherwise. */
        const gpu_ops *d = fx_gpu_driver.ops;
        if ((r = d->event_record(g->ev_out, g->stream)) == 0 && (r = d->stream_wait(cstream, g->ev_out)) == 0) {
            while (R.fn) {
                slot_t *s = &R.slots[R.fifo[R.fh]];
                int q = d->event_query(g->events[s->idx]);
                if (q != NOT_READY) {
                    copy_finished(&R, q);
                    continue;
                }
                R.ops[s->op].bytes += s->copied;
                g->st_bytes += s->copied;
                R.fh = (R.fh + 1) % g->nslots;
                R.fn--;
                R.ops[s->op].outstanding--;
            }
            R.copying = 0;
            g->pending = 1;
        } else {
            set_error(g, "ordering the caller's stream after the copies failed: %s (%d); waited for them instead",
                      fx_gpu_errname(r), r);
            while (R.fn)
                reap_copies(&R, 1);
            R.copying = 0;
            d->stream_sync(g->stream);
        }
    } else {
        /* Nothing may touch the staging slots after return. */
        fx_gpu_driver.ops->stream_sync(g->stream);
    }
    fx_gpu_driver.ops->ctx_leave(&sc);
    for (size_t i = 0; i < nops; i++) {
        op_t *o = &ops[i];
        if (o->err)
            res[i] = -o->err;
        else if (!o->issued_all || o->dropped)
            res[i] = -ECANCELED;
        else
            res[i] = (int64_t)o->bytes;
    }
    if (crcs) {
        for (int64_t p = 0; p < R.npieces; p++) {
            const struct piece_crc *pc = &R.pcrc[p];
            if (pc->len)
                ops[pc->op].crc = fx_crc32c_combine(ops[pc->op].crc, pc->crc, pc->len);
        }
        for (size_t i = 0; i < nops; i++)
            crcs[i] = res[i] < 0 ? 0 : ops[i].crc; /* no CRC of bytes that did not arrive */
    }
out:
    g->st_wall_ns = fx_now_ns() - t0;
    free(R.slots);
    free(R.fifo);
    free(R.pcrc);
    return ret;
}

/* ------------------------------------------------------------- fork */

/* A fork()ed child has no reader threads, no staging memory (MADV_DONTFORK),
 * a copy of the parent's ring and no usable GPU context: a pool made before
 * the fork (fx_fork_gen moved on since, or another pid) refuses every call
 * there with a RuntimeError naming fork, and close() forgets its resources
 * instead of freeing them. Its locks are never taken in the child (a parent
 * thread may have held one mid-read), so nothing there can hang. */
static int is_forked(const GpuStagingObject *g)
{
    return g->ready && (FX_FORKED(g->gen) || (g->pid && g->pid != getpid()));
}

static int refuse_forked(const GpuStagingObject *g)
{
    if (!is_forked(g))
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "GpuStaging was created before fork(): it cannot be used in the child "
                                        "(its threads, staging memory, io_uring ring and GPU context stay with "
                                        "the parent); create a new GpuReader in the child, or start it with "
                                        "spawn (CUDA cannot be used in a child forked after it was initialised)");
    return -1;
}

/* The driver's lock may have been held by a parent thread at fork. */
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void atfork_install(void) { pthread_atfork(NULL, NULL, fx_gpu_driver_atfork_child); }

/* ------------------------------------------------------------- Python side */

static int staging_init(GpuStagingObject *self, PyObject *args, PyObject *kw);

/* As Engine's: a second __init__ while the first builds without the GIL
 * would overwrite (leak) its memory, stream, events and ring. */
static int GpuStaging_init(GpuStagingObject *self, PyObject *args, PyObject *kw)
{
    int r;

    if (self->initialising) {
        PyErr_SetString(PyExc_RuntimeError, "GpuStaging is being initialised by another call");
        return -1;
    }
    self->initialising = 1;
    r = staging_init(self, args, kw);
    self->initialising = 0;
    return r;
}

static int staging_init(GpuStagingObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"slots", "slot_bytes", "device", "engine", "io_engine", "numa_sysfs", NULL};
    long long slots = 8, slot_bytes = 4 << 20;
    int device = 0, want_uring;
    PyObject *engine = Py_None;
    const char *io_engine = "auto", *sysfs = "/sys";
    char msg[512] = "";
    int r;

    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "GpuStaging is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|LLiOss", kwlist, &slots, &slot_bytes, &device, &engine,
                                     &io_engine, &sysfs))
        return -1;
    if (slots < 2 || slots > 1024) {
        PyErr_Format(PyExc_ValueError, "slots must be in 2..1024, not %lld", slots);
        return -1;
    }
    if (slot_bytes < (long long)FX_DIO_ALIGN || slot_bytes > (1ll << 30) || slot_bytes % FX_DIO_ALIGN) {
        PyErr_Format(PyExc_ValueError, "slot_bytes must be a multiple of 4096 in 4096..1 GiB, not %lld",
                     slot_bytes);
        return -1;
    }
    if (strcmp(io_engine, "auto") && strcmp(io_engine, "io_uring") && strcmp(io_engine, "threads")) {
        PyErr_Format(PyExc_ValueError, "io_engine must be 'auto', 'io_uring' or 'threads', not '%s'", io_engine);
        return -1;
    }
    want_uring = strcmp(io_engine, "threads") != 0 && fx_uring_available();
    if (engine != Py_None) {
        /* Follow the engine: its choice (or fallback) of io_uring; reads use
         * its rings when they hold a read per slot. */
        if (fx_engine_begin(engine) < 0)
            return -1;
        if (!fx_engine_uring(engine)) {
            /* Reads on the thread engine's pool, beside its batches. */
            want_uring = 0;
            self->pool = fx_engine_pool(engine);
            Py_INCREF(engine);
            self->engine = engine;
        } else if (want_uring && fx_engine_queue_depth(engine) >= (unsigned)slots) {
            self->eu = fx_engine_uring(engine);
            Py_INCREF(engine);
            self->engine = engine; /* held (begun) until the pool is built */
        }
        if (!self->engine)
            fx_engine_end(engine);
    }
    if (device < 0) {
        if (self->engine) {
            fx_engine_end(self->engine);
            self->eu = NULL;
            self->pool = NULL;
            Py_CLEAR(self->engine);
        }
        PyErr_Format(PyExc_ValueError, "device must be >= 0, not %d", device);
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS
    r = fx_gpu_driver_load();
    Py_END_ALLOW_THREADS
    if (r < 0 || device >= fx_gpu_driver.ndev) {
        if (self->engine) {
            fx_engine_end(self->engine);
            self->eu = NULL;
            self->pool = NULL;
            Py_CLEAR(self->engine);
        }
        if (r < 0)
            PyErr_Format(PyExc_OSError, "GPU driver unavailable: %s", fx_gpu_driver.err);
        else
            PyErr_Format(PyExc_ValueError, "device %d: the driver reports %d device(s)", device, fx_gpu_driver.ndev);
        return -1;
    }
    self->device = device;
    self->nslots = (unsigned)slots;
    self->slot_bytes = (size_t)slot_bytes;
    self->poll_us = 50;
    Py_BEGIN_ALLOW_THREADS
    r = staging_build(self, want_uring, sysfs, msg, sizeof(msg));
    if (r < 0)
        staging_free(self);
    Py_END_ALLOW_THREADS
    if (self->engine)
        fx_engine_end(self->engine);
    if (r < 0) {
        self->eu = NULL;
        self->pool = NULL;
        Py_CLEAR(self->engine);
    }
    if (r < 0) {
        PyErr_Format(PyExc_OSError, "GpuStaging: %s", msg);
        return -1;
    }
    if (!strcmp(io_engine, "io_uring") && !self->io) {
        Py_BEGIN_ALLOW_THREADS
        staging_free(self);
        Py_END_ALLOW_THREADS
        self->eu = NULL;
        self->pool = NULL;
        Py_CLEAR(self->engine); /* else a second __init__ takes another reference over it */
        PyErr_SetString(PyExc_OSError, "GpuStaging: io_engine='io_uring' but no io_uring ring could be set up");
        return -1;
    }
    self->pid = getpid();
    self->gen = fx_fork_gen;
    self->ready = 1;
    return 0;
}

static PyObject *GpuStaging_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    GpuStagingObject *self = (GpuStagingObject *)type->tp_alloc(type, 0);
    (void)args;
    (void)kw;
    if (!self)
        return NULL;
    pthread_mutex_init(&self->run_mu, NULL);
    pthread_mutex_init(&self->err_mu, NULL);
    return (PyObject *)self;
}

static void staging_close(GpuStagingObject *self)
{
    if (is_forked(self)) {
        /* A fork()ed child: the threads, the memory and the context are the
         * parent's; freeing them here would hang or corrupt. Forget them. */
        self->closed = 1;
        return;
    }
    pthread_mutex_lock(&self->run_mu);
    if (self->ready && !self->closed) {
        self->closed = 1;
        staging_free(self);
    }
    pthread_mutex_unlock(&self->run_mu);
}

static PyObject *GpuStaging_close(GpuStagingObject *self, PyObject *unused)
{
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    staging_close(self);
    Py_END_ALLOW_THREADS
    if (self->close_warning[0]) {
        /* A warning, not an exception: close() runs in cleanup paths. */
        char msg[sizeof(self->close_warning)];
        memcpy(msg, self->close_warning, sizeof(msg));
        self->close_warning[0] = 0;
        if (PyErr_WarnEx(PyExc_RuntimeWarning, msg, 1) < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

static void GpuStaging_dealloc(GpuStagingObject *self)
{
    int forked = is_forked(self);
    /* Unreachable from Python now: the teardown waits for the GPU and joins
     * threads, so other threads run meanwhile, as with close(). */
    Py_BEGIN_ALLOW_THREADS
    staging_close(self);
    Py_END_ALLOW_THREADS
    if (!forked) { /* in a child they may be held by a parent thread that does not exist here */
        pthread_mutex_destroy(&self->run_mu);
        pthread_mutex_destroy(&self->err_mu);
    }
    free(self->trace);
    if (!forked)
        Py_CLEAR(self->engine);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A read on an engine's rings: holds the engine (its close waits) and takes
 * one of its rings for the run; 0, or -1 (closed, or no ring to be had). */
static int take_engine_ring(GpuStagingObject *g)
{
    if (fx_engine_hold(g->engine) < 0)
        return -1;
    if (!(g->ring = fx_uring_take_ring(g->eu))) {
        fx_engine_end(g->engine);
        return -1;
    }
    return 0;
}

/* Every read of the run was reaped: the ring goes back (one left with
 * entries the kernel never took is thrown away instead). */
static void give_engine_ring(GpuStagingObject *g)
{
    if (g->broken || fx_uring_give_ring(g->eu, g->ring) < 0)
        fx_ring_discard(g->ring);
    g->broken = 0; /* that ring is gone; the next read takes another */
    g->ring = NULL;
    fx_engine_end(g->engine);
}

static PyObject *GpuStaging_read(GpuStagingObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"ops", "trace", "cancel_on_error", "stream", "sync", "crc", "why", NULL};
    PyObject *ops_obj, *seq, *out = NULL;
    int trace = 0, cancel_on_error = 1, closed = 0, sync = 1, want_crc = 0, want_why = 0, prev_failed = 0;
    char err[sizeof(self->last_error)] = "";
    unsigned long long stream = 0;
    Py_ssize_t n, i;
    op_t *ops;
    int64_t *res;
    uint32_t *crcs = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|ppKppp", kwlist, &ops_obj, &trace, &cancel_on_error, &stream,
                                     &sync, &want_crc, &want_why))
        return NULL;
    if (!self->ready) {
        PyErr_SetString(PyExc_ValueError, "GpuStaging is not initialised");
        return NULL;
    }
    if (refuse_forked(self))
        return NULL;
    seq = fx_sequence_snapshot(ops_obj, "ops must be a sequence of (fd, offset, length, device_address)");
    if (!seq)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    ops = calloc(n ? (size_t)n : 1, sizeof(*ops));
    res = calloc(n ? (size_t)n : 1, sizeof(*res));
    if (want_crc)
        crcs = calloc(n ? (size_t)n : 1, sizeof(*crcs));
    if (!ops || !res || (want_crc && !crcs)) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < n; i++) {
        long long fd, off, len;
        unsigned long long dev;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "LLLK;each op is (fd, offset, length, device_address)",
                              &fd, &off, &len, &dev))
            goto done;
        if (fd < 0 || fd > INT32_MAX || off < 0 || len < 0) {
            PyErr_Format(PyExc_ValueError, "op %zd: fd, offset and length must be >= 0", i);
            goto done;
        }
        if (len > 0 && dev == 0) {
            PyErr_Format(PyExc_ValueError, "op %zd: device address is NULL", i);
            goto done;
        }
        if ((uint64_t)off + (uint64_t)len > (uint64_t)INT64_MAX - FX_DIO_ALIGN) {
            /* an O_DIRECT op's end, rounded up to a block, would wrap */
            PyErr_Format(PyExc_ValueError, "op %zd: offset + length %llu beyond the largest file offset", i,
                         (unsigned long long)off + (unsigned long long)len);
            goto done;
        }
        ops[i].fd = (int)fd;
        ops[i].off = (uint64_t)off;
        ops[i].len = (uint64_t)len;
        ops[i].dev = dev;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->run_mu);
    if (self->closed || self->broken) {
        closed = 1;
    } else if (self->eu ? take_engine_ring(self) < 0 : self->engine && fx_engine_hold(self->engine) < 0) {
        closed = 2;
    } else {
        self->tracing = trace;
        prev_failed = run_pipeline(self, ops, (size_t)n, res, crcs, cancel_on_error, (void *)(uintptr_t)stream, sync) < 0;
        if (self->eu)
            give_engine_ring(self);
        else if (self->engine)
            fx_engine_end(self->engine);
        /* This read's error, taken before the next read clears it */
        memcpy(err, self->last_error, sizeof(err));
        pthread_mutex_lock(&self->err_mu);
        memcpy(self->shown_error, err, sizeof(err));
        pthread_mutex_unlock(&self->err_mu);
    }
    pthread_mutex_unlock(&self->run_mu);
    Py_END_ALLOW_THREADS
    if (closed) {
        PyErr_SetString(closed == 2 ? PyExc_OSError : PyExc_ValueError,
                        closed == 2       ? "GpuStaging: its engine is closed (or has no io_uring ring to lend)"
                        : self->broken ? "GpuStaging is unusable after an io_uring failure"
                                       : "GpuStaging is closed");
        goto done;
    }
    if (prev_failed) {
        PyErr_SetString(PyExc_RuntimeError, err);
        goto done;
    }
    out = PyList_New(n);
    for (i = 0; out && i < n; i++) {
        /* with crc: (bytes, CRC32C) per op, as Engine.read(ops, crc=True) */
        PyObject *v = crcs ? Py_BuildValue("(LI)", (long long)res[i], crcs[i]) : PyLong_FromLongLong(res[i]);
        if (!v) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, v);
    }
    if (out && want_why) { /* (results, this read's first error or None): other threads' reads leave it be */
        PyObject *pair = err[0] ? Py_BuildValue("(Os)", out, err) : Py_BuildValue("(OO)", out, Py_None);
        Py_SETREF(out, pair);
    }
done:
    Py_DECREF(seq);
    free(ops);
    free(res);
    free(crcs);
    return out;
}

static PyObject *GpuStaging_last_trace(GpuStagingObject *self, PyObject *unused)
{
    PyObject *out;
    (void)unused;
    if (refuse_forked(self))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->run_mu); /* waits for a running read() */
    Py_END_ALLOW_THREADS
    out = PyList_New((Py_ssize_t)self->ntrace);
    for (size_t i = 0; out && i < self->ntrace; i++) {
        trace_ev *e = &self->trace[i];
        PyObject *v = Py_BuildValue("(KsiLLL)", (unsigned long long)e->t, trace_names[e->kind], e->slot,
                                    (long long)e->op, (long long)e->piece, (long long)e->val);
        if (!v) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    pthread_mutex_unlock(&self->run_mu);
    return out;
}

static PyObject *GpuStaging_last_stats(GpuStagingObject *self, PyObject *unused)
{
    (void)unused;
    if (refuse_forked(self))
        return NULL;
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "wall_ns", (unsigned long long)self->st_wall_ns,
                         "bytes", (unsigned long long)self->st_bytes, "reads", (unsigned long long)self->st_reads,
                         "copies", (unsigned long long)self->st_copies, "copies_during_reads",
                         (unsigned long long)self->st_overlap_copies, "max_reads_in_flight",
                         (unsigned long long)self->st_max_reads, "copy_waits",
                         (unsigned long long)self->st_copy_waits, "crc_ns",
                         (unsigned long long)self->st_crc_ns, "crc_bytes", (unsigned long long)self->st_crc_bytes);
}

static PyObject *g_address(GpuStagingObject *g, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong((uintptr_t)g->mem);
}
static PyObject *g_size(GpuStagingObject *g, void *c)
{
    (void)c;
    return PyLong_FromSize_t((size_t)g->nslots * g->slot_bytes);
}
static PyObject *g_slot_bytes(GpuStagingObject *g, void *c)
{
    (void)c;
    return PyLong_FromSize_t(g->slot_bytes);
}
static PyObject *g_slots(GpuStagingObject *g, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLong(g->nslots);
}
static PyObject *g_device(GpuStagingObject *g, void *c)
{
    (void)c;
    return PyLong_FromLong(g->device);
}
static PyObject *g_pinned(GpuStagingObject *g, void *c)
{
    (void)c;
    return PyBool_FromLong(g->pinned);
}
static PyObject *g_pin_error(GpuStagingObject *g, void *c)
{
    (void)c;
    if (!g->pin_error[0])
        Py_RETURN_NONE;
    return PyUnicode_FromString(g->pin_error);
}
static PyObject *g_fixed(GpuStagingObject *g, void *c)
{
    (void)c;
    return PyBool_FromLong(g->fixed);
}
static PyObject *g_fixed_error(GpuStagingObject *g, void *c)
{
    (void)c;
    if (!g->fixed_error[0])
        Py_RETURN_NONE;
    return PyUnicode_FromString(g->fixed_error);
}
static PyObject *g_io_error(GpuStagingObject *g, void *c)
{
    (void)c;
    if (!g->io_error[0])
        Py_RETURN_NONE;
    return PyUnicode_FromString(g->io_error);
}
static PyObject *g_numa_node(GpuStagingObject *g, void *c)
{
    (void)c;
    return PyLong_FromLong(g->numa_node);
}
static PyObject *g_numa_info(GpuStagingObject *g, void *c)
{
    (void)c;
    return PyUnicode_FromString(g->numa_info);
}
static PyObject *g_forked(GpuStagingObject *g, void *c)
{
    (void)c;
    return PyBool_FromLong(is_forked(g));
}
static PyObject *g_io(GpuStagingObject *g, void *c)
{
    (void)c;
    return PyUnicode_FromString(g->io ? "io_uring" : "threads");
}
static PyObject *g_driver(GpuStagingObject *g, void *c)
{
    (void)g;
    (void)c;
    return PyUnicode_FromString(fx_gpu_driver.path);
}
static PyObject *g_last_error(GpuStagingObject *g, void *c)
{
    char err[sizeof(g->shown_error)];
    (void)c;
    pthread_mutex_lock(&g->err_mu);
    memcpy(err, g->shown_error, sizeof(err));
    pthread_mutex_unlock(&g->err_mu);
    if (!err[0])
        Py_RETURN_NONE;
    return PyUnicode_FromString(err);
}
static PyObject *g_closed(GpuStagingObject *g, void *c)
{
    (void)c;
    return PyBool_FromLong(g->closed);
}
static PyObject *g_poll_get(GpuStagingObject *g, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLong(g->poll_us);
}
static int g_poll_set(GpuStagingObject *g, PyObject *v, void *c)
{
    long x;
    (void)c;
    if (!v || (x = PyLong_AsLong(v)) < 1 || x > 1000000) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "poll_us must be in 1..1000000");
        return -1;
    }
    g->poll_us = (unsigned)x;
    return 0;
}

static PyGetSetDef GpuStaging_getset[] = {
    {"address", (getter)g_address, NULL, "start of the staging memory", NULL},
    {"size", (getter)g_size, NULL, "slots * slot_bytes", NULL},
    {"slot_bytes", (getter)g_slot_bytes, NULL, "largest piece", NULL},
    {"slots", (getter)g_slots, NULL, "staging slots (reads + copies in flight)", NULL},
    {"device", (getter)g_device, NULL, "GPU ordinal", NULL},
    {"pinned", (getter)g_pinned, NULL, "staging is page-locked by the driver", NULL},
    {"pin_error", (getter)g_pin_error, NULL, "why it is not, or None", NULL},
    {"fixed_buffers", (getter)g_fixed, NULL, "slots are io_uring fixed buffers", NULL},
    {"fixed_error", (getter)g_fixed_error, NULL, "why io_uring refused them as fixed buffers, or None", NULL},
    {"io_error", (getter)g_io_error, NULL, "why reads run on threads where io_uring was asked for, or None", NULL},
    {"numa_node", (getter)g_numa_node, NULL, "NUMA node the staging memory is bound to, or -1", NULL},
    {"numa_info", (getter)g_numa_info, NULL, "how the staging memory was placed, and why", NULL},
    {"forked", (getter)g_forked, NULL, "this process is a fork()ed child of the pool's: unusable", NULL},
    {"io", (getter)g_io, NULL, "'io_uring' or 'threads'", NULL},
    {"driver", (getter)g_driver, NULL, "path of the GPU driver library", NULL},
    {"last_error", (getter)g_last_error, NULL, "first error of the last read(), or None", NULL},
    {"closed", (getter)g_closed, NULL, "close() was called", NULL},
    {"poll_us", (getter)g_poll_get, (setter)g_poll_set, "copy polling interval while reads are out", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef GpuStaging_methods[] = {
    {"read", (PyCFunction)(void (*)(void))GpuStaging_read, METH_VARARGS | METH_KEYWORDS,
     "read(ops, trace=False, cancel_on_error=True, stream=0, sync=True, crc=False, why=False) -> list: bytes copied to the "
     "GPU or -errno per op ((bytes, CRC32C of them) with crc, checksummed in the staging slots). Copies start after the work queued on `stream` (the caller's CUstream/hipStream_t, 0: the "
     "default stream) so far; sync=False returns once every copy is queued and makes `stream` wait for them; "
     "why=True: (that list, this read's first error or None)"},
    {"last_trace", (PyCFunction)GpuStaging_last_trace, METH_NOARGS,
     "last_trace() -> [(t_ns, kind, slot, op, piece, value)] of the last read(trace=True)"},
    {"last_stats", (PyCFunction)GpuStaging_last_stats, METH_NOARGS, "last_stats() -> dict of the last read()"},
    {"close", (PyCFunction)GpuStaging_close, METH_NOARGS, "wait for a running read, free everything"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GpuStagingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lmcache_fx._fxio.GpuStaging",
    .tp_basicsize = sizeof(GpuStagingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "GpuStaging(slots=8, slot_bytes=4 MiB, device=0, engine=None, io_engine='auto'): "
              "pinned staging and pipelined file -> GPU reads",
    .tp_new = GpuStaging_new,
    .tp_init = (initproc)GpuStaging_init,
    .tp_dealloc = (destructor)GpuStaging_dealloc,
    .tp_methods = GpuStaging_methods,
    .tp_getset = GpuStaging_getset,
};

/* ---------------------------------------------------------- module functions */

static PyObject *mod_gpu_driver(PyObject *m, PyObject *unused)
{
    int r;
    (void)m;
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    r = fx_gpu_driver_load();
    Py_END_ALLOW_THREADS
    if (r < 0) /* "found": a driver library without a usable device, or None (z: NULL is None) */
        return Py_BuildValue("{s:O,s:O,s:i,s:s,s:z,s:z}", "api", Py_None, "path", Py_None, "devices", 0, "error",
                             fx_gpu_driver.err, "found", fx_gpu_driver.found[0] ? fx_gpu_driver.found : NULL,
                             "found_api", fx_gpu_driver.found_api);
    return Py_BuildValue("{s:s,s:s,s:i,s:O,s:s,s:s}", "api", fx_gpu_driver.ops->api, "path", fx_gpu_driver.path,
                         "devices", fx_gpu_driver.ndev, "error", Py_None, "found", fx_gpu_driver.path, "found_api",
                         fx_gpu_driver.ops->api);
}

/* Can io_uring register this memory as a fixed buffer? Uses a throwaway ring,
 * so no engine's registration is disturbed. 0 or -errno. */
static PyObject *mod_uring_register_probe(PyObject *m, PyObject *args)
{
    unsigned long long addr, len;
    int r = -ENOSYS;
    (void)m;
    if (!PyArg_ParseTuple(args, "KK", &addr, &len))
        return NULL;
#ifdef FX_HAVE_LIBURING
    Py_BEGIN_ALLOW_THREADS
    {
        fx_ring *ring = fx_ring_new(2, 0, &r);
        if (ring) {
            size_t n = (size_t)((len + (1ull << 30) - 1) >> 30), i;
            struct iovec *iov = calloc(n ? n : 1, sizeof(*iov));
            if (!iov) {
                r = -ENOMEM;
            } else {
                for (i = 0; i < n; i++) {
                    iov[i].iov_base = (char *)(uintptr_t)addr + (i << 30);
                    iov[i].iov_len = len - (i << 30) < (1ull << 30) ? len - (i << 30) : (1ull << 30);
                }
                r = fx_ring_register_buffers(ring, iov, (unsigned)n);
                free(iov);
            }
            fx_ring_discard(ring);
        }
    }
    Py_END_ALLOW_THREADS
#else
    (void)addr;
    (void)len;
#endif
    return PyLong_FromLong(r);
}

static PyObject *mod_gpu_numa_node(PyObject *m, PyObject *args)
{
    const char *bus, *sysfs = "/sys";
    (void)m;
    if (!PyArg_ParseTuple(args, "s|s", &bus, &sysfs))
        return NULL;
    return PyLong_FromLong(numa_node_of(bus, sysfs));
}

static PyMethodDef gpu_functions[] = {
    {"gpu_numa_node", (PyCFunction)mod_gpu_numa_node, METH_VARARGS,
     "gpu_numa_node(pci_bus_id, sysfs='/sys') -> NUMA node of the PCI device, or -1"},
    {"gpu_driver", (PyCFunction)mod_gpu_driver, METH_NOARGS,
     "gpu_driver() -> {'api', 'path', 'devices', 'error'}: loads the driver once"},
    {"uring_register_probe", (PyCFunction)mod_uring_register_probe, METH_VARARGS,
     "uring_register_probe(address, length) -> 0 or -errno: can io_uring pin this memory"},
    {NULL, NULL, 0, NULL},
};

int fx_gpu_module_init(PyObject *module)
{
    pthread_once(&atfork_once, atfork_install);
    if (PyType_Ready(&GpuStagingType) < 0)
        return -1;
    if (PyModule_AddObjectRef(module, "GpuStaging", (PyObject *)&GpuStagingType) < 0)
        return -1;
    for (PyMethodDef *d = gpu_functions; d->ml_name; d++) {
        PyObject *f = PyCFunction_New(d, NULL);
        if (!f || PyModule_AddObject(module, d->ml_name, f) < 0) {
            Py_XDECREF(f);
            return -1;
        }
    }
    return 0;
}
