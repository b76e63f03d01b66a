/* lmcache-fx C core: shared definitions.
 *
 * The core owns I/O and memory, not policy: it takes a batch of operations
 * (fd, offset, length, address), cuts each into sub-reads ("pieces") of at most
 * split_bytes, keeps up to queue_depth of them in flight, and reports per
 * operation the bytes done or -errno (optionally with a CRC32C of the bytes).
 */
#ifndef FXIO_H
#define FXIO_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>
#include <time.h>

/* Monotonic clock in ns: the GPU pipeline's trace and stage times,
 * read_chunks' engine and GIL-wait times. */
static inline uint64_t fx_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* O_DIRECT alignment used for buffers, offsets and lengths.  4 KiB covers
 * every logical block size seen on NVMe, virtio and loop devices. */
#define FX_DIO_ALIGN 4096u

#define FX_STR_(x) #x
#define FX_STR(x) FX_STR_(x) /* a macro's value as a string literal, for doc strings */

typedef struct {
    int fd;
    uint64_t offset;
    uint64_t length;
    char *buf;
    /* Optional (NULL: none): a read-only mapping of the file's first map_len
     * bytes; reads of pieces inside it copy from it (fx_map_copy). */
    const char *map;
    uint64_t map_len;
    /* The device the file lies on (st_dev; st_rdev of a block device file),
     * 0: unknown, and fx_batch_prepare takes it from its own fstat. */
    uint64_t dev;
} fx_op;

typedef struct {
    int64_t result; /* bytes transferred, or -errno */
    uint32_t crc;   /* CRC32C of the bytes, when asked for */
} fx_result;

/* One piece of an operation, at most split_bytes long. */
typedef struct {
    uint32_t op;     /* index of its operation */
    int direct;      /* fd has O_DIRECT */
    uint64_t offset; /* advances on short transfers */
    uint64_t length; /* remaining */
    char *buf;
    char *start;     /* where the piece began, for its CRC */
    uint64_t done;   /* bytes transferred once finished */
    uint32_t crc;    /* CRC32C of those bytes, when asked for */
    uint32_t retries; /* resubmissions so far (EAGAIN, EINTR, short transfers) */
    /* A fused piece (read_chunks): FX_HDR_SIZE bytes of the file just before
     * offset land at hdr, then the piece's own bytes at buf, in one vectored
     * read. Cleared once the header part is in; length may be 0. */
    char *hdr;
    struct iovec iov[2]; /* io_uring: the READV's vector, alive until it completes */
    /* A read served from memory (a buffered fd: the page cache; or tmpfs,
     * ramfs): a copy the io_uring engine hands to io-wq workers so copies
     * run on every core instead of inline in the submitting thread. */
    int mem;
    unsigned slots; /* io_uring: engine-wide slots it holds while in flight */
    int summed;     /* crc was taken while copying (from a mapping) */
    /* io_uring, a staged piece (fx_batch.stage_direct): the staging slot it
     * reads into (buf points there); once it lands its bytes go on to start
     * with their CRC32C in one pass (fx_piece_checksum). NULL: none. */
    char *stage;
} fx_piece;

/* A piece is resubmitted at most this many times after -EAGAIN, -EINTR or a
 * short transfer; then it fails with that errno (-EIO for a short transfer). */
#define FX_RETRY_MAX 32

/* Per-operation progress while a batch runs. */
typedef struct {
    uint32_t first;    /* index of its first piece; its pieces are contiguous */
    uint32_t count;    /* number of pieces */
    uint32_t pending;  /* pieces not finished */
    uint64_t bytes;    /* bytes done */
    int err;           /* first errno seen, 0 if none */
    uint64_t dev;      /* the op's device (fx_op.dev), 0: unknown */
} fx_progress;

typedef struct fx_batch {
    const fx_op *ops;
    size_t nops;
    fx_result *res;
    fx_progress *prog;
    fx_piece *pieces;
    size_t npieces;
    int write;
    int want_crc;
    /* Optional (NULL: none): per op, where the FX_HDR_SIZE bytes just before
     * its offset go (NULL: none), read together with the op's first piece;
     * and per op the header bytes read or -errno. Reads only. */
    char *const *hdrs;
    int64_t *hdr_res;
    /* 0: each op's fd is probed (fcntl, fstat); FX_FDS_BUFFERED or
     * FX_FDS_DIRECT: the caller vouches that every fd is a regular file
     * opened without / with O_DIRECT. */
    int fds_known;
    /* Optional (NULL: none): threads that may checksum landed pieces in
     * parallel (io_uring engine; the thread engine already checksums on its
     * workers), at most crc_width at a time. One reaping thread checksums
     * ~13 GB/s of memory-cold data: less than a many-drive array reads. */
    struct fx_pool *crc_pool;
    int crc_width;
    /* Pieces read from memory with a CRC32C go through a staging buffer of
     * the reading thread's (batch.c, run_staged); set by the engine. */
    int staged;
    /* Checked O_DIRECT reads (not from memory) land in a staging slot (of
     * the process's pool, small enough to stay in the CPU's cache) and go
     * on to their destination with the one-pass copy and CRC32C: where the
     * device's own transfer is a CPU copy (a loop device), one pass over
     * memory fewer than a read into place and a sum of it. io_uring engine
     * only (uring_engine.c, STAGE_SLOT); the caller chooses per medium. */
    int stage_direct;
    /* Optional (NULL: never): once set, pieces not yet begun end -ECANCELED
     * without I/O, so a cancelled read waits only for what is in flight
     * (Batch.cancel of a running batch). Reads only. */
    const atomic_int *stop;
} fx_batch;

static inline int fx_batch_stopped(const fx_batch *b)
{
    return b->stop && atomic_load_explicit(b->stop, memory_order_relaxed);
}

enum { FX_FDS_PROBE = 0, FX_FDS_BUFFERED = 1, FX_FDS_DIRECT = 2, FX_FDS_MEM = 4 /* | with DIRECT */ };

/* Whether the filesystem of fd (device dev) keeps files in memory (tmpfs,
 * ramfs, hugetlbfs); *last_dev / *last_mem cache the previous answer. */
int fx_fd_in_memory(int fd, uint64_t dev, uint64_t *last_dev, int *last_mem);

/* Bytes of a chunk file's header (the payload follows at this offset). */
#define FX_HDR_SIZE 4096u
/* Where a header keeps its payload's CRC32C, and its own CRC32C (of the
 * bytes before it); chunkfile.py's layout. */
#define FX_HDR_PCRC_OFF 24u
#define FX_HDR_CRC_OFF (FX_HDR_SIZE - 4u)

/* How many times landed pieces were checksummed on several threads (tests). */
extern _Atomic unsigned long fx_crc_spread_runs;
extern _Atomic unsigned long fx_uring_peak_inflight;
/* io_uring pieces the kernel cancelled unasked (no io-wq worker could be
 * started for them), then run on the reaping thread. */
extern _Atomic unsigned long fx_uring_sync_pieces;
/* Where this thread's last io_uring run ended: its engine's slots returned
 * so far when it returned its last (tests: an order of ends that the
 * scheduler's and the GIL's delays do not blur, as wall-clock ends do). */
extern _Thread_local unsigned long fx_uring_last_end;
/* Pieces copied from a mapping, copies whose source faulted, and pieces
 * read through a staging buffer (tests). */
extern _Atomic unsigned long fx_map_pieces, fx_map_faults, fx_staged_pieces;
/* O_DIRECT pieces read through an io_uring staging slot, and the staging
 * buffers the process has made (kept; tests). */
extern _Atomic unsigned long fx_direct_staged_pieces;
/* Payloads read as one request under FX_OPEN_WHOLE (tests). */
extern _Atomic unsigned long fx_whole_payloads;
/* Waves of chunk files read_chunks read on its second lane (tests), and
 * nonzero when every read_chunks keeps to one lane (probes and tests). */
extern _Atomic unsigned long fx_helper_waves;
extern _Atomic int fx_chunk_one_lane;
unsigned fx_stage_buffers(void);
/* Makes every staging buffer a store striped over `devices` devices may use
 * now (a store that stages, at open); returns how many the process has. */
unsigned fx_stage_prepare(unsigned devices);
/* fx_chunks_write calls running in this process (a store beside a load). */
extern _Atomic int fx_chunk_writes_running;

/* Builds pieces and progress for a batch; returns 0 or -errno. */
int fx_batch_prepare(fx_batch *b, uint64_t split_bytes);
void fx_batch_release(fx_batch *b);
/* CRC32C of a finished piece's bytes (res > 0), when the batch wants CRCs.
 * Engines call it outside their locks: it is the costly part. */
void fx_piece_checksum(const fx_batch *b, fx_piece *p, int64_t res);
/* Records a finished piece (res = bytes or -errno). Not thread-safe on its
 * own: callers serialise per batch. Returns 1 when it was the op's last. */
int fx_piece_finish(fx_batch *b, fx_piece *p, int64_t res);
/* Sets an op's result (and CRC) once its last piece finished; no lock needed. */
void fx_op_complete(fx_batch *b, size_t i);
/* Runs one piece with pread/pwrite, including the O_DIRECT bounce for an
 * unaligned piece. Returns bytes or -errno. */
int64_t fx_piece_run_sync(const fx_batch *b, fx_piece *p);
/* Whether a piece on an O_DIRECT fd must go through a bounce buffer. */
int fx_piece_needs_bounce(const fx_piece *p);
/* After a short transfer (0 < got < want) at pos on fd: how many of the got
 * bytes to keep before continuing at pos + kept (O_DIRECT continues from an
 * aligned position, re-reading a few bytes), or -1 when the read ended at the
 * end of the file (got is then the final count). */
int64_t fx_short_keep(int write, int direct, int fd, uint64_t pos, uint64_t got);
/* Fails every op of a batch that has not finished with -err. */
void fx_batch_fail_all(fx_batch *b, int err);
/* A fused piece's header read returned got bytes (0 < got < FX_HDR_SIZE) at
 * file offset pos: 1 when that is the end of the file, else 0. */
int fx_hdr_at_eof(int fd, uint64_t pos, uint64_t got);
/* Records a fused piece's header result (bytes or -errno) and makes it a
 * plain piece. */
void fx_piece_header_done(const fx_batch *b, fx_piece *p, int64_t res);

/* ---- copies from a file mapping (csrc/mapped.c) ----
 * len bytes from src, inside the mapping [lo, hi), to dst, with their
 * CRC32C in *crc when want_crc: len, or -EFAULT when the source faulted
 * (a file truncated meanwhile; dst is then partly written) or lies outside.
 * Only after fx_map_guard_ready returned 1 on some thread. */
int64_t fx_map_copy(char *dst, const char *src, uint64_t len, const char *lo, const char *hi, int want_crc,
                    uint32_t *crc);
/* Puts the SIGBUS handler that guards those copies in place (again, when
 * another took its place); 1 when it is, else 0 (copy no mapping then). */
int fx_map_guard_ready(void);

/* ---- memory: one aligned (huge-page) allocator (csrc/mem.c) ---- */
#define FX_HUGE_2M ((size_t)2 << 20)
typedef struct {
    char *addr;
    size_t mapped;  /* bytes mapped: size rounded up to 4 KiB, or 2 MiB when huge */
    int huge;       /* 2 MiB-aligned, MADV_HUGEPAGE */
    int numa_node;  /* node it was bound to, or -1 */
    int numa_err;   /* errno of a refused mbind, else 0 */
} fx_mem;
/* Anonymous memory, MADV_DONTFORK; huge: 2 MiB-aligned with MADV_HUGEPAGE;
 * numa_node >= 0: bound there (preferred) before any page is touched;
 * prefault: every page faulted in. 0 or -errno. */
int fx_mem_alloc(fx_mem *m, size_t size, int huge, int numa_node, int prefault);
void fx_mem_free(fx_mem *m);

/* ---- fork safety ----
 * A child handler (pthread_atfork, installed once by fx_fork_guard_init) bumps
 * the process generation: an engine, pool, ring or buffer remembers the
 * generation it was made in and refuses to run in a forked child, whose copy
 * has no I/O threads and shares the parent's rings. */
extern _Atomic unsigned fx_fork_gen;
int fx_fork_guard_init(void);
#define FX_FORKED(gen) (__builtin_expect((gen) != fx_fork_gen, 0))

/* ---- fault injection, for tests ----
 * LMCACHE_FX_FAULT="kind:count,..." read at engine creation (fx_fault_setup)
 * arms counters; each fault point fires while its counter lasts. Off, a fault
 * point costs one predictable branch on fx_fault_on.
 *   wait_eintr   an io_uring wait returns -EINTR without waiting
 *   submit_fail  a submission goes to the kernel, then reports -EIO (abort)
 *   eagain       a read/write completes with -EAGAIN (pread: EAGAIN)
 *   eintr        a read/write completes with -EINTR (pread: EINTR)
 *   short        a read/write transfers about half of what it asked for
 *   map_truncate a piece about to be copied from a mapping has its file cut
 *                to its header first (a real truncation under the live
 *                mapping, as another process could make: the copy faults)
 *   no_clone     a ring's fixed buffers are not cloned from the engine's
 *                table (IORING_REGISTER_CLONE_BUFFERS refused, as on
 *                kernels before 6.12) */
enum {
    FX_FAULT_WAIT_EINTR,
    FX_FAULT_SUBMIT_FAIL,
    FX_FAULT_EAGAIN,
    FX_FAULT_EINTR,
    FX_FAULT_SHORT,
    FX_FAULT_MAP_TRUNCATE,
    FX_FAULT_NO_CLONE,
    FX_FAULT_MAP_CUT,
    FX_FAULT_NKINDS
};
extern _Atomic int fx_fault_on;
/* Consumes one firing of a fault point; its ordinal (1, 2, ...) or 0. */
long fx_fault_hit(int kind);
#define FX_FAULT(kind) (__builtin_expect(fx_fault_on, 0) ? fx_fault_hit(kind) : 0)
/* Parses spec (NULL or "" disarms); 0, or -1 with a message in why. */
int fx_fault_setup(const char *spec, char *why, size_t whylen);
const char *fx_fault_name(int kind);
/* How many times a fault point fired since the last fx_fault_setup. */
long fx_fault_fired(int kind);
/* Bytes a 'short' fault lets through of res (< res), or res when too small. */
int64_t fx_fault_short(int64_t res, long ordinal);

/* CRC32C (Castagnoli), hardware-accelerated where the CPU has it. */
uint32_t fx_crc32c(uint32_t crc, const void *buf, size_t len);
/* Copies len bytes from src to dst and returns fx_crc32c(crc, src, len),
 * in one pass where the CPU allows (512-bit folding with streaming stores;
 * dst 64-byte aligned and len >= 1024): the sum costs no second read. */
uint32_t fx_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len);
/* Whether fx_crc32c_copy runs in one pass on this CPU (else: a copy, then
 * a sum of each 64 KiB while it is in cache). */
int fx_crc32c_copy_one_pass(void);
/* CRC of A followed by B from crc(A), crc(B) and len(B). */
uint32_t fx_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
const char *fx_crc32c_impl(void);
/* The implementations this CPU runs (each passed the start-up self-test),
 * the one in use first: up to max names, returns how many. */
size_t fx_crc32c_impls(const char **names, size_t max);
/* fx_crc32c with a named one of those (tests, scripts/crc32c_speed.py);
 * 0, or -1 when this CPU does not run it. */
int fx_crc32c_with(const char *name, uint32_t crc, const void *buf, size_t len, uint32_t *out);

/* Chunk reads with O_DIRECT from a device and verify off: pieces of at
 * least this (chunks.c, unchecked_split). */
#define FX_UNCHECKED_PIECE (16u << 20)

/* ---- chunk files: open, read header + payload, check, close ----
 * A batch of chunk files <dirfd>/<name> (name relative, no symlink followed
 * anywhere, no ".." escape): each opened O_RDONLY|O_NOFOLLOW|O_CLOEXEC
 * [|O_DIRECT], fstat'ed, its 4 KiB header read to scratch + i * FX_HDR_SIZE
 * and its payload (offset FX_HDR_SIZE, `length` bytes) to dest in one
 * vectored read, checked, and closed. Status per chunk: 0, -errno, or one of
 * these (the on-disk format of lmcache_fx/core/chunkfile.py): */
enum {
    FX_CHUNK_OK = 0,
    FX_CHUNK_SHORT = 1,       /* header or payload came back short (see size) */
    FX_CHUNK_BAD_MAGIC = 2,   /* not an lmcache-fx chunk */
    FX_CHUNK_BAD_CRC = 3,     /* header CRC32C mismatch */
    FX_CHUNK_VERSION = 4,     /* a well-formed header of another format version */
    FX_CHUNK_BAD_HEADER = 5,  /* header size or meta length out of range */
    FX_CHUNK_LENGTH = 6,      /* payload length differs from the destination's */
    FX_CHUNK_META = 7,        /* the JSON body differs from the expected bytes */
    FX_CHUNK_PAYLOAD_CRC = 8, /* payload CRC32C mismatch (verify) */
    FX_CHUNK_NCODES
};

typedef struct {
    int dirfd;
    const char *name;
    char *dest;
    uint64_t length;
    const char *expect; /* exact JSON body expected, or NULL: not checked */
    uint32_t expect_len;
} fx_chunk;

typedef struct {
    int64_t status;   /* FX_CHUNK_* or -errno */
    int64_t nbytes;   /* payload bytes read (or -errno) */
    uint64_t dev, ino; /* fstat of the file opened; 0 when none was */
    int64_t size;      /* its st_size, or -1 */
} fx_chunk_result;

typedef int (*fx_run_fn)(void *ctx, fx_batch *b);
struct fx_pool;
/* How fx_chunks_read opens files (`how`, a mask). */
#define FX_OPEN_DIRECT 1 /* O_DIRECT */
/* An OFD read lock on each file, held until it is closed: -ESTALE when a
 * writer holds a lock on it (an evicted file being rewritten with another
 * chunk; one rewritten before the lock holds that chunk's key). */
#define FX_OPEN_LOCK 2
/* Payloads of files of at least FX_MAP_MIN bytes on a memory filesystem are
 * copied from a mapping of the file and summed in the same pass (see
 * csrc/mapped.c); where no mapping can be had, read as without it. */
#define FX_OPEN_MAP 4
/* Checked O_DIRECT payloads through a staging buffer (fx_batch.stage_direct). */
#define FX_OPEN_STAGE 8
/* The read is one of several at once (other awaited reads running or
 * waiting as it starts): an O_DIRECT payload read in place of at most
 * FX_WHOLE_MAX goes as one request, not split_bytes pieces. A lone read's
 * pieces overlap one's check with the next one's transfer; with every CPU
 * busy nothing overlaps, and each piece is a completion and a wake-up more
 * (2 MiB awaited loads on the XFS loop, three runs: p50 0.87-0.93x with 16
 * in flight, 0.93-0.98x with 4). Larger payloads keep their pieces: at 3
 * and 4 MiB whole reads left the p50 level and the p99 worse (docs/
 * benchmarks.md, "Small payloads whole under load"). */
#define FX_OPEN_WHOLE 16
#define FX_WHOLE_MAX_MIB 2 /* module.c quotes it; options.py and _fxio.pyi repeat it (tests/test_options.py) */
#define FX_WHOLE_MAX ((uint64_t)FX_WHOLE_MAX_MIB << 20)
#define FX_MAP_MIN ((uint64_t)2 << 20)
/* Runs the whole list (in waves bounded by open files; a list of several
 * waves on two lanes, the calling thread and a runner, one wave each); no
 * GIL. Opens run on up to open_width threads of `openers` when given (a
 * cold open reads the inode: a wait per file), else on the lane's thread.
 * Once *stop (optional) is set, no further wave opens and no further piece
 * is read: those chunks end -ECANCELED. 0 or -errno (-ENOMEM, -EOWNERDEAD);
 * per-chunk failures are in out. */
int fx_chunks_read(const fx_chunk *c, size_t n, char *scratch, int how, int verify,
                   uint64_t split, fx_run_fn run, void *ctx, struct fx_pool *openers,
                   int open_width, const atomic_int *stop, fx_chunk_result *out);
const char *fx_chunk_status_name(int status);
/* lstat of <dirfd>/<name>, no symlink followed on the way: 0 or -errno. */
struct stat;
int fx_stat_beneath(int dirfd, const char *name, struct stat *st);
/* atime and mtime of that regular file set to ns, the same way: 0 or -errno. */
int fx_utime_beneath(int dirfd, const char *name, long long ns);

/* ---- chunk files written, one pipeline per chunk ----
 * Each temporary fd (opened by the caller, its size reserved) gets its
 * payload at FX_HDR_SIZE and the payload's CRC32C; the header the caller
 * encoded at hdr gets that CRC and its own, and is written at 0 (on O_DIRECT
 * with an aligned payload, header and payload in one request); then, with
 * mtime_ns > 0, the file's mtime (the store's LRU clock). Renaming into
 * place stays with the caller (under its store lock, which counts what a
 * rename replaces). Chunks run in parallel on up to width of pool's threads
 * (NULL: on the calling thread); no GIL. */
typedef struct {
    int fd;
    const char *src;
    uint64_t length;
    char *hdr; /* FX_HDR_SIZE bytes, 4096-aligned */
    int64_t mtime_ns;
} fx_wchunk;

typedef struct {
    int64_t nbytes; /* payload bytes written, or -errno */
    int64_t hdr;    /* header bytes written, or -errno (0: not reached) */
    uint32_t crc;   /* CRC32C of the payload */
    int clock;      /* 1: mtime set; 0: not asked or not reached; -errno */
} fx_wchunk_result;

/* 0, or -EOWNERDEAD (a forked child: nothing run). */
int fx_chunks_write(const fx_wchunk *c, size_t n, int direct, struct fx_pool *pool, int width,
                    fx_wchunk_result *out);

/* ---- one I/O, for the submit / reap APIs (fx_ring, fx_tq) ---- */
typedef struct {
    int fd;
    int write;
    char *buf;
    uint64_t len;
    uint64_t off;
    int fixed;               /* registered buffer index, or -1: a plain read/write */
    const struct iovec *iov; /* non-NULL: a vectored read of niov entries (buf, len unused) */
    unsigned niov;
    int async;               /* ring: hand to io-wq (IOSQE_ASYNC) */
    int direct;              /* thread pool: fd has O_DIRECT (short reads resume block-aligned) */
    void *tag;               /* comes back in its event */
} fx_io;
typedef struct {
    void *tag;
    int res; /* bytes or -errno, as the kernel gave it */
} fx_event;
/* One I/O with pread/pwrite on the calling thread, no batch needed: the
 * O_DIRECT bounce for unaligned buffers, offsets or lengths, and the retry
 * ladder for EINTR / EAGAIN / short transfers. Bytes or -errno. */
int64_t fx_io_sync(int fd, int write, int direct, char *buf, uint64_t len, uint64_t off);
/* A chunk file's header and payload in one pwritev at offset 0, O_DIRECT
 * (hdr, src and len 4096-aligned), retried on EINTR/EAGAIN. Returns len, or
 * -errno (-ENOSPC for a short write). */
int64_t fx_write_fused(int fd, char *hdr, const char *src, uint64_t len);

/* ---- runners (runner.c): the threads batches run on, kept between batches ---- */
typedef void *(*fx_runner_work)(void *arg);
typedef void (*fx_runner_fn)(void *arg);
/* Runs fn(arg) and then done(fn's result) on an idle runner or a new one,
 * which is listed idle again between the two, `steps` (0..19) priority steps
 * below the calling thread (at most nice 19); 0, or -EAGAIN. fn returns what
 * its last step is about: a chain of batches ends on another than it began. */
int fx_runner_start(fx_runner_work fn, fx_runner_fn done, void *arg, int steps);
unsigned fx_runners_idle(void);
unsigned long fx_runners_started(void);

/* ---- thread engine ---- */
typedef struct fx_pool fx_pool;
fx_pool *fx_pool_create(int nthreads);
void fx_pool_destroy(fx_pool *pool);
int fx_pool_run(fx_pool *pool, fx_batch *b, int queue_depth);
int fx_pool_nthreads(const fx_pool *pool);
/* Runs fn(ctx, i) for i in 0..n-1 on up to width of the pool's threads and
 * waits for all; 0, or -EOWNERDEAD in a forked child (nothing run). */
typedef void (*fx_task_fn)(void *ctx, size_t i);
int fx_pool_parallel(fx_pool *pool, size_t n, fx_task_fn fn, void *ctx, int width);
/* The same, started in the background: NULL when nothing was started (n is
 * 0, a forked child, no memory: then run the tasks yourself). Every started
 * group must be waited for with fx_tasks_wait (which frees it). */
typedef struct fx_tasks fx_tasks;
fx_tasks *fx_pool_spawn(fx_pool *pool, size_t n, fx_task_fn fn, void *ctx, int width);
void fx_tasks_wait(fx_pool *pool, fx_tasks *t);

/* Submit / reap on a pool's threads, as fx_ring does on a ring: I/O queued
 * with fx_tq_queue runs (fx_io_sync) on up to `width` of the pool's threads,
 * then after(actx, tag, result) on that thread when given (work to do in
 * parallel, a CRC say); fx_tq_getevents reaps (timeout_us < 0: waits for one
 * unless none is outstanding; 0: none; else at most that long). At most cap
 * outstanding (queued, running or not reaped): -EBUSY beyond. Vectored I/O
 * is not supported here (-EINVAL). fx_tq_free is refused (-EBUSY) while any
 * is outstanding. */
typedef struct fx_tq fx_tq;
typedef void (*fx_tq_after)(void *actx, void *tag, int64_t res);
fx_tq *fx_tq_new(fx_pool *pool, unsigned cap, int width);
int fx_tq_free(fx_tq *q);
int fx_tq_queue(fx_tq *q, const fx_io *io, fx_tq_after after, void *actx);
int fx_tq_getevents(fx_tq *q, fx_event *ev, unsigned max, long timeout_us);
unsigned fx_tq_outstanding(const fx_tq *q);

/* ---- io_uring engine ---- */
typedef struct fx_uring fx_uring;
/* ---- rings: submit / reap (csrc/ring.c; fio's queue / commit / getevents) ----
 * One ring-setup path with one fallback ladder for unsupported flags. A ring
 * is either an engine's (fx_uring_take_ring / fx_uring_give_ring) or one of
 * its own (fx_ring_new / fx_ring_free); both are driven the same way:
 * fx_ring_queue what to do, fx_ring_commit, fx_ring_getevents. Every read the
 * kernel took must be reaped before its memory or the ring goes: give back
 * and free are refused (-EBUSY) while any is in flight. */
typedef struct fx_ring fx_ring;
/* A ring of `entries` (rounded up by the kernel); iowq_max > 0 bounds its
 * io-wq workers for file I/O. NULL with -errno in *err. */
fx_ring *fx_ring_new(unsigned entries, unsigned iowq_max, int *err);
/* 0, or -EBUSY (nothing freed) while reads are queued or in flight. */
int fx_ring_free(fx_ring *r);
/* After a failed commit: reaps nothing, frees the ring (its unsubmitted
 * entries die with it). Only when nothing is in flight. */
void fx_ring_discard(fx_ring *r);
/* One NOP through a new ring: 0, or -errno where io_uring_enter is refused. */
int fx_ring_works(fx_ring *r);
/* After a failed commit: forgets the entries the kernel never took (the ring
 * must then be discarded once what is in flight was reaped); how many. */
unsigned fx_ring_unqueue(fx_ring *r);
/* Registers n fixed buffers; 0 or -errno. */
int fx_ring_register_buffers(fx_ring *r, const struct iovec *iov, unsigned n);
unsigned fx_ring_inflight(const fx_ring *r);
unsigned fx_ring_queued(const fx_ring *r);
/* Prepares one I/O; 0, or -EBUSY when the submission queue is full. */
int fx_ring_queue(fx_ring *r, const fx_io *io);
/* Hands what is queued to the kernel; 0, or -errno when the ring failed
 * (whatever it took is in flight and must still be reaped). Transient
 * refusals (EINTR, EAGAIN, EBUSY) leave the rest queued and return 0. */
int fx_ring_commit(fx_ring *r);
/* Commits, then reaps up to max completions. timeout_us < 0: waits until at
 * least one (unless nothing is in flight), retrying EINTR / EAGAIN / EBUSY /
 * ETIME at once and any other wait error after a peek and 1 ms; never blocks
 * without a timeout on entries the kernel has not taken. timeout_us >= 0:
 * waits at most that long. Returns the number reaped (0: none yet), or
 * -errno from the commit. */
int fx_ring_getevents(fx_ring *r, fx_event *ev, unsigned max, long timeout_us);
/* Takes a ring of the engine's (its registration in place), or NULL (none to
 * be had: out of descriptors, or a forked child). */
fx_ring *fx_uring_take_ring(fx_uring *u);
/* Gives it back; -EBUSY (kept by the caller) while reads are in flight. */
int fx_uring_give_ring(fx_uring *u, fx_ring *r);

/* Returns NULL and a reason in *why when io_uring cannot be used. */
fx_uring *fx_uring_create(unsigned queue_depth, char *why, size_t whylen);
void fx_uring_destroy(fx_uring *u);
int fx_uring_run(fx_uring *u, fx_batch *b);
/* The order a read's pieces are queued in on the rings (batch.c); NULL: as
 * they lie. *ndevs: the devices its files lie on. */
size_t *fx_piece_order(const fx_batch *b, unsigned *ndevs);
/* Nonzero: every read keeps op order (probes and tests). */
extern _Atomic int fx_piece_order_ops;
/* Registers [addr, addr+len) as a fixed buffer on every ring; 0 or -errno
 * (-EOPNOTSUPP: the table is too large to pin again on each ring, and the
 * kernel cannot share one registration among them, before Linux 6.12).
 * (Region 0 of the table; NULL removes it.) */
int fx_uring_register(fx_uring *u, void *addr, size_t len);
int fx_uring_registered(const fx_uring *u);
/* The largest table registered on every ring where the kernel cannot
 * clone one ring's registration into another; and whether it can. */
#define FX_FIXED_PER_RING_MAX ((size_t)256 << 20)
int fx_uring_shares_registration(void);
/* Room for more than one registration per ring: regions 1.. of the same
 * table (a GPU staging pool beside LMCache's pool). A handle > 0, or -errno
 * (-ENOSPC: none free; a refusal leaves the other regions registered).
 * Rings pick the new table up when next taken. */
#define FX_URING_REGIONS 4
int fx_uring_register_extra(fx_uring *u, void *addr, size_t len);
void fx_uring_unregister_extra(fx_uring *u, int handle);
/* The fixed-buffer index on ring r (taken from u) holding [addr, addr+len),
 * or -1 (not registered there: use a plain read). */
int fx_ring_fixed_index(fx_uring *u, const fx_ring *r, const void *addr, uint64_t len);
int fx_uring_available(void);

#endif
