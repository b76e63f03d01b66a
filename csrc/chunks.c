/* Chunk files in one call: for a list of (dirfd, name, destination, length)
 * open each file relative to its directory without following any symlink,
 * fstat it, read its 4 KiB header into a scratch area and its payload into
 * the destination with one vectored read per file (the engine's fused
 * pieces; larger payloads continue in split_bytes pieces), check the header
 * against the on-disk format of lmcache_fx/core/chunkfile.py, and close it.
 * Policy (what a failure means, removing files, the index) stays with the
 * caller: it gets a status, the bytes read and the file's identity. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "fxio.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the chunk header is little-endian; this reader assumes a little-endian host"
#endif

/* The fixed header fields (chunkfile.py: "<8sHHIQIIQ", CRC at 4092). */
#define H_MAGIC 0
#define H_VERSION 8
#define H_FLAGS 10
#define H_HSIZE 12
#define H_PLEN 16
#define H_PCRC FX_HDR_PCRC_OFF
#define H_MLEN 28
#define H_META 40
#define H_CRC FX_HDR_CRC_OFF
#define FORMAT_VERSION 1
#define FLAG_MAC 1
#define FLAG_CHECK_PAYLOAD 2
#define MAX_META (FX_HDR_SIZE - H_META - 4)    /* 4052 */
#define MAX_META_MAC (FX_HDR_SIZE - 4 - 32 - H_META) /* 4020: a MAC sits at 4060 */

static const char MAGIC[8] = {'L', 'M', 'C', 'F', 'X', 'K', 'V', 0};

static const char *const status_names[FX_CHUNK_NCODES] = {
    [FX_CHUNK_OK] = "ok",
    [FX_CHUNK_SHORT] = "short",
    [FX_CHUNK_BAD_MAGIC] = "bad_magic",
    [FX_CHUNK_BAD_CRC] = "bad_header_crc",
    [FX_CHUNK_VERSION] = "format_version",
    [FX_CHUNK_BAD_HEADER] = "bad_header",
    [FX_CHUNK_LENGTH] = "length_mismatch",
    [FX_CHUNK_META] = "meta_mismatch",
    [FX_CHUNK_PAYLOAD_CRC] = "payload_crc",
};

const char *fx_chunk_status_name(int status)
{
    return status >= 0 && status < FX_CHUNK_NCODES ? status_names[status] : NULL;
}

/* ------------------------------------------------------------------ open */

static _Atomic int no_openat2;

/* Walks name one component at a time, each directory opened O_NOFOLLOW
 * (a symlink is ELOOP), refusing absolute names and "..": the fallback
 * where openat2 (Linux 5.6) is missing or filtered. */
static int open_walk(int dirfd, const char *name, int flags)
{
    char buf[PATH_MAX];
    char *comp, *next;
    int cur = dirfd, fd;

    if (name[0] == '/')
        return -EXDEV;
    if (strlen(name) >= sizeof(buf))
        return -ENAMETOOLONG;
    strcpy(buf, name);
    for (comp = buf; comp; comp = next) {
        next = strchr(comp, '/');
        if (next)
            *next++ = 0;
        while (next && *next == '/')
            next++;
        if (next && !*next)
            next = NULL; /* a trailing slash */
        if (strcmp(comp, "..") == 0) {
            fd = -EXDEV;
        } else if (!*comp || strcmp(comp, ".") == 0) {
            continue;
        } else if (next) {
            fd = openat(cur, comp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            fd = fd < 0 ? -errno : fd;
        } else {
            fd = openat(cur, comp, flags);
            fd = fd < 0 ? -errno : fd;
        }
        if (cur != dirfd)
            close(cur);
        if (fd < 0 || !next)
            return fd;
        cur = fd;
    }
    if (cur != dirfd)
        close(cur);
    return -EISDIR; /* name had no file component */
}

/* An fd for <dirfd>/<name> or -errno; no symlink is followed anywhere in
 * name (ELOOP), nothing outside dirfd is reached (EXDEV). */
static int open_beneath(int dirfd, const char *name, int flags)
{
    if (!atomic_load_explicit(&no_openat2, memory_order_relaxed)) {
        struct open_how how;
        long fd;

        memset(&how, 0, sizeof(how));
        how.flags = (uint64_t)flags;
        how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
        fd = syscall(SYS_openat2, dirfd, name, &how, sizeof(how));
        if (fd >= 0)
            return (int)fd;
        /* ENOSYS: before 5.6; EPERM: a seccomp profile that does not know
         * it (our flags never make openat2 itself answer EPERM). */
        if (errno != ENOSYS && errno != EPERM)
            return -errno;
        atomic_store(&no_openat2, 1);
    }
    return open_walk(dirfd, name, flags);
}

/* lstat of <dirfd>/<name> with no symlink followed on the way (a planted
 * fan-out directory is ELOOP, as for a read; a symlink as the last component
 * is stat'ed itself): a lookup sees exactly the files a read would open.
 * 0 or -errno. */
int fx_stat_beneath(int dirfd, const char *name, struct stat *st)
{
    int r, fd = open_beneath(dirfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);

    if (fd < 0)
        return fd;
    r = fstat(fd, st) < 0 ? -errno : 0;
    close(fd);
    return r;
}

/* Sets the atime and mtime of the regular file <dirfd>/<name> to ns, no
 * symlink followed on the way (utimensat's AT_SYMLINK_NOFOLLOW covers only
 * the last component: a planted fan-out link led outside the store). Opened
 * as a read opens it (O_NONBLOCK: a planted FIFO does not block). 0 or -errno. */
int fx_utime_beneath(int dirfd, const char *name, long long ns)
{
    struct timespec ts[2];
    struct stat st;
    int r, fd = open_beneath(dirfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);

    if (fd < 0)
        return fd;
    ts[0].tv_sec = ts[1].tv_sec = (time_t)(ns / 1000000000LL);
    ts[0].tv_nsec = ts[1].tv_nsec = (long)(ns % 1000000000LL);
    if (fstat(fd, &st) < 0)
        r = -errno;
    else if (!S_ISREG(st.st_mode))
        r = -EINVAL;
    else if (futimens(fd, ts) == 0)
        r = 0;
    else if (errno != EPERM)
        r = -errno;
    else {
        /* Another user's file in a shared-group store: exact times need its
         * owner, "now" needs only write access (the group's). A peer's hit
         * must still keep the chunk from the evictor. */
        ts[0].tv_nsec = ts[1].tv_nsec = UTIME_NOW;
        r = futimens(fd, ts) < 0 ? -errno : 0;
    }
    close(fd);
    return r;
}

/* With FX_OPEN_LOCK: an OFD read lock on the whole file, so that an
 * evictor (store.py, _open_deferred) cannot take its write lock and
 * rewrite the file while it is read. 0, -ESTALE (a writer holds a lock:
 * the file is being rewritten with another chunk) or -errno. A file that
 * was moved away and rewritten before the lock holds another chunk, whole:
 * its header's key tells (the caller's check, as for any misplaced file),
 * which spares a path lookup per chunk here. A kernel without OFD locks
 * (EINVAL) reads unlocked: its evictor cannot lock either, so reuses nothing. */
static int chunk_lock(int fd)
{
    struct flock fl;

    memset(&fl, 0, sizeof(fl));
    fl.l_type = F_RDLCK;
    fl.l_whence = SEEK_SET; /* l_start 0, l_len 0: the whole file */
    if (fcntl(fd, F_OFD_SETLK, &fl) == 0 || errno == EINVAL)
        return 0;
    return errno == EAGAIN || errno == EACCES ? -ESTALE : -errno;
}

/* Opens one chunk: 0 and *fd, or -errno (with the identity when an fd was
 * had: a non-regular file in a chunk's place is reported, not read). */
static int chunk_open(const fx_chunk *c, int how, int *fd_out, fx_chunk_result *r)
{
    /* O_NONBLOCK: a FIFO planted in a chunk's place must not block the
     * open; cleared again for the reads (io_uring would answer EAGAIN). */
    int flags = O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | ((how & FX_OPEN_DIRECT) ? O_DIRECT : 0);
    struct stat st;
    int e, fd = open_beneath(c->dirfd, c->name, flags);

    if (fd < 0)
        return fd;
    if (fstat(fd, &st) < 0) {
        e = -errno;
        close(fd);
        return e;
    }
    r->dev = (uint64_t)st.st_dev;
    r->ino = (uint64_t)st.st_ino;
    r->size = (int64_t)st.st_size;
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return S_ISDIR(st.st_mode) ? -EISDIR : -ESPIPE;
    }
    if (fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) < 0) {
        e = -errno;
        close(fd);
        return e;
    }
    if ((how & FX_OPEN_LOCK) && (e = chunk_lock(fd)) < 0) {
        close(fd);
        return e;
    }
    *fd_out = fd;
    return 0;
}

/* ----------------------------------------------------------------- checks */

static uint16_t le16(const unsigned char *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static uint32_t le32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static uint64_t le64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* The checks of chunkfile.decode_header, in its order, then the payload. */
static int64_t check_chunk(const fx_chunk *c, const unsigned char *h, int64_t hres,
                           const fx_result *pr, int verify)
{
    uint32_t mlen;

    if (hres < 0)
        return hres;
    if (hres < (int64_t)FX_HDR_SIZE)
        return FX_CHUNK_SHORT;
    if (memcmp(h + H_MAGIC, MAGIC, sizeof(MAGIC)) != 0)
        return FX_CHUNK_BAD_MAGIC;
    if (fx_crc32c(0, h, H_CRC) != le32(h + H_CRC))
        return FX_CHUNK_BAD_CRC;
    if (le16(h + H_VERSION) != FORMAT_VERSION)
        return FX_CHUNK_VERSION;
    mlen = le32(h + H_MLEN);
    if (le32(h + H_HSIZE) != FX_HDR_SIZE ||
        mlen > ((le16(h + H_FLAGS) & FLAG_MAC) ? MAX_META_MAC : MAX_META))
        return FX_CHUNK_BAD_HEADER;
    if (le64(h + H_PLEN) != c->length)
        return FX_CHUNK_LENGTH;
    if (c->expect && (mlen != c->expect_len || memcmp(h + H_META, c->expect, mlen) != 0))
        return FX_CHUNK_META;
    if (pr->result < 0)
        return pr->result;
    if ((uint64_t)pr->result != c->length)
        return FX_CHUNK_SHORT;
    if (verify && pr->crc != le32(h + H_PCRC))
        return FX_CHUNK_PAYLOAD_CRC;
    /* Written by a store that reuses evicted chunks' files: after a power
     * cut a header can stand over part of another chunk's payload, which only
     * the CRC tells. Checked whatever `verify` says (chunkfile.py,
     * FLAG_CHECK_PAYLOAD); the payload is in host memory at c->dest by now. */
    if (!verify && (le16(h + H_FLAGS) & FLAG_CHECK_PAYLOAD) &&
        fx_crc32c(0, c->dest, c->length) != le32(h + H_PCRC))
        return FX_CHUNK_PAYLOAD_CRC;
    return FX_CHUNK_OK;
}

/* ------------------------------------------------------------------- run */

/* Files of one wave: an eighth of the descriptor limit (two waves are open
 * at once, one on each lane), 16..1024, and no more than 64 when they are
 * opened on a pool of openers: no read overlaps the first wave's opens. */
static size_t wave_size(size_t n, int pipelined)
{
    struct rlimit rl;
    size_t w = 128;

    if (getrlimit(RLIMIT_NOFILE, &rl) == 0)
        w = rl.rlim_cur == RLIM_INFINITY ? 1024 : (size_t)rl.rlim_cur / 8;
    if (w < 16)
        w = 16;
    if (w > 1024)
        w = 1024;
    if (pipelined && w > 64)
        w = 64;
    return w < n ? w : n;
}

/* The piece size of one wave. Pieces are there so that each one's CRC32C
 * is taken as it lands; O_DIRECT reads from a device with no check to take
 * go in pieces of at least FX_UNCHECKED_PIECE, one request per payload up to
 * there, which costs less CPU per GB and reads faster (docs/benchmarks.md,
 * "Piece size"); the bytes in flight stay bounded (a piece holds one engine
 * slot per MiB). Reads from memory keep their pieces: there pieces spread
 * the copying over threads. */
static uint64_t unchecked_split(uint64_t split, int device, int verify)
{
    return device && !verify && split < FX_UNCHECKED_PIECE ? FX_UNCHECKED_PIECE : split;
}

/* FX_OPEN_WHOLE: the wave's largest payload as the piece size, where it is
 * over `split` and at most FX_WHOLE_MAX (larger ones keep their pieces). */
static uint64_t whole_split(const fx_op *ops, size_t m, uint64_t split)
{
    uint64_t most = 0;

    for (size_t k = 0; k < m; k++)
        most = ops[k].length > most ? ops[k].length : most;
    if (most <= split || most > FX_WHOLE_MAX)
        return split;
    fx_whole_payloads += m;
    return most;
}

typedef struct {
    const fx_chunk *c;
    fx_chunk_result *out;
    int how; /* FX_OPEN_* */
    size_t cand;
    size_t *idx; /* chunk index of each slot */
    int *fds;    /* per slot: fd or -errno */
    fx_tasks *tasks; /* opens running in the background, or NULL */
} wave;

static void open_one(void *ctx, size_t k)
{
    wave *o = ctx;
    size_t i = o->idx[k];
    int fd = -1, r = chunk_open(&o->c[i], o->how, &fd, &o->out[i]);

    o->fds[k] = r < 0 ? r : fd;
}

typedef struct {
    size_t n, next, w;
    size_t *retry; /* room for two waves: each lane gives back at most one */
    size_t nretry;
} feeder;

/* A wave's chunks (those that ran out of descriptors first), at most w;
 * 0 when none are left. */
static size_t wave_pick(feeder *f, wave *v)
{
    size_t k, r = f->nretry < f->w ? f->nretry : f->w;

    v->cand = 0;
    v->tasks = NULL;
    for (k = 0; k < r; k++)
        v->idx[v->cand++] = f->retry[k];
    memmove(f->retry, f->retry + r, (f->nretry - r) * sizeof(*f->retry));
    f->nretry -= r;
    while (v->cand < f->w && f->next < f->n)
        v->idx[v->cand++] = f->next++;
    return v->cand;
}

/* Maps the files of a wave read from memory (FX_OPEN_MAP), those of at
 * least FX_MAP_MIN bytes as fstat saw them: the engine then copies their
 * pieces from the mappings. A file that cannot be mapped is read. */
static void map_files(fx_op *ops, size_t m, const size_t *which, const fx_chunk_result *out)
{
    if (!fx_map_guard_ready())
        return;
    for (size_t k = 0; k < m; k++) {
        int64_t size = out[which[k]].size;
        void *a;

        if (size < (int64_t)FX_MAP_MIN)
            continue;
        a = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, ops[k].fd, 0);
        if (a == MAP_FAILED)
            continue;
        ops[k].map = a;
        ops[k].map_len = (uint64_t)size;
    }
}

/* A lane takes one wave at a time: opens its files, reads them as one batch,
 * closes them. A list of more than one wave goes down two lanes, the calling
 * thread and a runner, so that the next wave's reads are queued while the
 * last pieces of the one before finish: with waves read one after the other
 * each ended with the devices draining, the busiest one last (2 MiB chunks
 * over eight devices capped at 50 MB/s each read at 0.83x of one wave the
 * size of the read; docs/benchmarks.md, "Waves"). The two batches at once may
 * take a second io_uring ring of the engine's (kept, as for concurrent
 * reads). Alone, the calling thread opens the next wave while it reads one. */
typedef struct {
    wave v;
    fx_op *ops; /* the batch of its files that opened */
    fx_result *res;
    char **hdrs;
    int64_t *hdr_res;
    size_t *which; /* chunk index of each op */
    size_t m;      /* ops: the wave's files that opened */
    int all_mem;   /* every one of them in memory (fx_fd_in_memory) */
    unsigned long closes_seen; /* reader.closes when this wave was taken */
} lane;

typedef struct {
    const fx_chunk *c;
    fx_chunk_result *out;
    char *scratch;
    int how, verify;
    uint64_t split;
    fx_run_fn run;
    void *ctx;
    fx_pool *openers;
    int width;
    pthread_mutex_t mu; /* the feeder, ret, active, closes, helper_done */
    pthread_cond_t cv;  /* closes, helper_done */
    feeder f;
    int ret;              /* a run's own failure (-ENOMEM, -EOWNERDEAD): no lane takes another wave */
    int active;           /* lanes with files open, or opening them */
    unsigned long closes; /* waves whose files were closed, ever */
    int helper_done;
    const atomic_int *stop; /* NULL, or set by a cancel: no further wave, no further piece */
    lane lanes[2];
} reader;

/* Takes the next wave and opens its files (on the openers when there are
 * several and some threads to run them); 0 when none is left or a run
 * failed. */
static int lane_take(reader *R, lane *L)
{
    wave *v = &L->v;
    size_t got;

    pthread_mutex_lock(&R->mu);
    got = R->ret == 0 && !(R->stop && atomic_load(R->stop)) ? wave_pick(&R->f, v) : 0;
    L->closes_seen = R->closes;
    if (got)
        R->active++;
    pthread_mutex_unlock(&R->mu);
    if (!got)
        return 0;
    if (got > 1 && R->openers && R->width > 1)
        v->tasks = fx_pool_spawn(R->openers, got, open_one, v, R->width);
    if (!v->tasks)
        for (size_t k = 0; k < got; k++)
            open_one(v, k);
    return 1;
}

/* Waits for a taken wave's opens and makes a batch of the files that
 * opened (lane_read runs it). Files that found no descriptor go back for a
 * later wave when a lane may have held descriptors since they were opened
 * (this one, or the other, which may have closed them since); else they
 * fail. A lane that opened nothing while the other holds or opens files
 * waits for those to close, or for that lane to find it holds none, before
 * it opens again. */
static void lane_opened(reader *R, lane *L)
{
    wave *v = &L->v;
    const fx_chunk *c = R->c;
    fx_chunk_result *out = R->out;
    int direct = R->how & FX_OPEN_DIRECT, all_mem = 1, last_mem = -1, emfile = 0;
    uint64_t last_dev = 0;
    size_t m = 0, k;

    fx_tasks_wait(R->openers, v->tasks);
    v->tasks = NULL;
    for (k = 0; k < v->cand; k++) {
        size_t i = v->idx[k];
        int fd = v->fds[k];

        if (fd >= 0) {
            L->ops[m].fd = fd;
            L->ops[m].offset = FX_HDR_SIZE;
            L->ops[m].length = c[i].length;
            L->ops[m].buf = c[i].dest;
            L->ops[m].map = NULL;
            L->ops[m].map_len = 0;
            L->ops[m].dev = out[i].dev; /* from the fstat at its open */
            L->hdrs[m] = R->scratch + i * FX_HDR_SIZE;
            L->which[m++] = i;
            if (direct && all_mem)
                all_mem = fx_fd_in_memory(fd, out[i].dev, &last_dev, &last_mem);
        } else if (fd == -EMFILE || fd == -ENFILE) {
            emfile = 1;
        } else {
            out[i].status = fd;
            out[i].nbytes = fd;
        }
    }
    pthread_mutex_lock(&R->mu);
    if (m == 0) {
        R->active--; /* holds nothing */
        pthread_cond_broadcast(&R->cv);
    }
    for (k = 0; emfile && k < v->cand; k++) {
        int fd = v->fds[k];

        if (fd != -EMFILE && fd != -ENFILE)
            continue;
        if (R->active > 0 || R->closes != L->closes_seen) {
            /* fits: what the list and both lanes' waves hold is at most 2w */
            R->f.retry[R->f.nretry++] = v->idx[k];
        } else {
            out[v->idx[k]].status = fd;
            out[v->idx[k]].nbytes = fd;
        }
    }
    if (m == 0 && emfile)
        while (R->active > 0 && R->closes == L->closes_seen)
            pthread_cond_wait(&R->cv, &R->mu);
    pthread_mutex_unlock(&R->mu);
    if ((R->how & FX_OPEN_MAP) && (!direct || all_mem))
        map_files(L->ops, m, L->which, out);
    L->m = m;
    L->all_mem = all_mem;
}

/* Runs the files of a wave that opened as one batch, closes them and checks
 * each chunk. */
static void lane_read(reader *R, lane *L)
{
    const fx_chunk *c = R->c;
    fx_chunk_result *out = R->out;
    int direct = R->how & FX_OPEN_DIRECT, all_mem = L->all_mem, r = 0;
    int device = direct && !all_mem; /* O_DIRECT from a device, not a memory file */
    size_t m = L->m, k;
    fx_batch b;

    if (m > 0) {
        memset(&b, 0, sizeof(b));
        b.ops = L->ops;
        b.nops = m;
        b.res = L->res;
        b.want_crc = R->verify;
        b.stage_direct = (R->how & FX_OPEN_STAGE) != 0;
        b.crc_pool = R->openers;
        b.crc_width = R->width;
        b.hdrs = L->hdrs;
        b.hdr_res = L->hdr_res;
        b.stop = R->stop;
        b.fds_known = direct ? FX_FDS_DIRECT | (all_mem ? FX_FDS_MEM : 0) : FX_FDS_BUFFERED;
        uint64_t split = unchecked_split(R->split, device, R->verify);

        if ((R->how & FX_OPEN_WHOLE) && device && !b.stage_direct)
            split = whole_split(L->ops, m, split);
        r = fx_batch_prepare(&b, split);
        if (r == 0) {
            r = R->run(R->ctx, &b);
            fx_batch_release(&b);
        }
        for (k = 0; k < m; k++) {
            size_t ci = L->which[k];

            if (L->ops[k].map) {
                struct stat st;

                /* A file cut meanwhile by less than a page reads as zeros up
                 * to the page's end, with no SIGBUS: what lies past its end
                 * now was not read. */
                if (r == 0 && L->res[k].result > 0) {
                    int64_t have = fstat(L->ops[k].fd, &st) < 0 ? -EIO
                                   : st.st_size > (off_t)L->ops[k].offset
                                       ? (int64_t)st.st_size - (int64_t)L->ops[k].offset
                                       : 0;

                    if (have < L->res[k].result)
                        L->res[k].result = have;
                }
                munmap((void *)L->ops[k].map, L->ops[k].map_len);
            }
            close(L->ops[k].fd);
            if (r < 0) {
                out[ci].status = r;
                out[ci].nbytes = r;
                continue;
            }
            out[ci].nbytes = L->res[k].result;
            out[ci].status = check_chunk(&c[ci], (const unsigned char *)L->hdrs[k],
                                         L->hdr_res[k] == -EINPROGRESS ? -EIO : L->hdr_res[k], &L->res[k],
                                         R->verify);
        }
    }
    pthread_mutex_lock(&R->mu);
    if (m > 0) {
        R->active--;
        R->closes++;
        pthread_cond_broadcast(&R->cv);
    }
    if ((r == -ENOMEM || r == -EOWNERDEAD) && R->ret == 0)
        R->ret = r;
    pthread_mutex_unlock(&R->mu);
}

/* One of two lanes: its waves one at a time, while the other lane reads;
 * returns how many it read. */
static unsigned long lane_loop(reader *R, lane *L)
{
    unsigned long waves = 0;

    for (; lane_take(R, L); waves++) {
        lane_opened(R, L);
        lane_read(R, L);
    }
    return waves;
}

/* The calling thread alone (one wave, or no runner to be had, or
 * _set_one_lane): each wave read while the next one's files open. */
static void solo_loop(reader *R, lane *cur, lane *nxt)
{
    int have = lane_take(R, cur);

    while (have) {
        int next;

        lane_opened(R, cur);
        next = nxt && lane_take(R, nxt);
        lane_read(R, cur);
        if (!nxt) {
            /* One lane: chunks that found no descriptor beside this wave's
             * files go again, now that those are closed. */
            have = lane_take(R, cur);
            continue;
        }
        if (next) {
            lane *t = cur;

            cur = nxt;
            nxt = t;
        }
        have = next;
    }
}

static void *helper_lane(void *arg)
{
    reader *R = arg;

    atomic_fetch_add(&fx_helper_waves, lane_loop(R, &R->lanes[1]));
    return R;
}

/* The runner's last touch of R: the calling thread frees it once woken. */
static void helper_finished(void *arg)
{
    reader *R = arg;

    pthread_mutex_lock(&R->mu);
    R->helper_done = 1;
    pthread_cond_broadcast(&R->cv);
    pthread_mutex_unlock(&R->mu);
}

static int lane_alloc(lane *L, const reader *R, size_t w)
{
    L->v.c = R->c;
    L->v.out = R->out;
    L->v.how = R->how;
    L->v.idx = calloc(w, sizeof(size_t));
    L->v.fds = calloc(w, sizeof(int));
    L->ops = calloc(w, sizeof(*L->ops));
    L->res = calloc(w, sizeof(*L->res));
    L->hdrs = calloc(w, sizeof(*L->hdrs));
    L->hdr_res = calloc(w, sizeof(*L->hdr_res));
    L->which = calloc(w, sizeof(*L->which));
    return L->v.idx && L->v.fds && L->ops && L->res && L->hdrs && L->hdr_res && L->which ? 0 : -ENOMEM;
}

static void lane_free(lane *L)
{
    free(L->v.idx);
    free(L->v.fds);
    free(L->ops);
    free(L->res);
    free(L->hdrs);
    free(L->hdr_res);
    free(L->which);
}

int fx_chunks_read(const fx_chunk *c, size_t n, char *scratch, int how, int verify,
                   uint64_t split, fx_run_fn run, void *ctx, struct fx_pool *openers,
                   int open_width, const atomic_int *stop, fx_chunk_result *out)
{
    reader R = {.c = c, .out = out, .scratch = scratch, .how = how, .verify = verify, .split = split,
                .run = run, .ctx = ctx, .openers = openers, .width = open_width, .stop = stop};
    int nlanes, ret = 0;

    for (size_t k = 0; k < n; k++) {
        out[k].status = -ECANCELED;
        out[k].nbytes = 0;
        out[k].dev = out[k].ino = 0;
        out[k].size = -1;
    }
    if (n == 0)
        return 0;
    R.f.n = n;
    R.f.w = wave_size(n, openers && open_width > 1);
    nlanes = n > R.f.w ? 2 : 1; /* the second lane's buffers also hold the wave opened next when alone */
    R.f.retry = calloc(2 * R.f.w, sizeof(*R.f.retry));
    for (int j = 0; j < nlanes; j++)
        if (lane_alloc(&R.lanes[j], &R, R.f.w) < 0)
            ret = -ENOMEM;
    if (!R.f.retry || ret < 0) {
        ret = -ENOMEM;
        goto out;
    }
    pthread_mutex_init(&R.mu, NULL);
    pthread_cond_init(&R.cv, NULL);
    R.helper_done = 1;
    if (nlanes == 2 && !atomic_load_explicit(&fx_chunk_one_lane, memory_order_relaxed)) {
        R.helper_done = 0;
        if (fx_runner_start(helper_lane, helper_finished, &R, 0) < 0)
            R.helper_done = 1; /* no thread to be had */
    }
    if (R.helper_done)
        solo_loop(&R, &R.lanes[0], nlanes == 2 ? &R.lanes[1] : NULL);
    else
        lane_loop(&R, &R.lanes[0]);
    pthread_mutex_lock(&R.mu);
    while (!R.helper_done)
        pthread_cond_wait(&R.cv, &R.mu);
    pthread_mutex_unlock(&R.mu);
    pthread_cond_destroy(&R.cv);
    pthread_mutex_destroy(&R.mu);
    ret = R.ret;
out:
    for (int j = 0; j < nlanes; j++)
        lane_free(&R.lanes[j]);
    free(R.f.retry);
    return ret;
}
