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
    return FX_CHUNK_OK;
}

/* ------------------------------------------------------------------- run */

/* Files of one wave: an eighth of the descriptor limit (two waves are open
 * at once), 16..1024, and no more than 64 when they are read from a pool of
 * openers, so the next wave opens while this one reads. */
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
    const fx_chunk *c;
    size_t n, next, w;
    size_t *retry;
    size_t nretry;
    fx_pool *openers;
    int width;
} feeder;

/* Picks a wave's chunks (those that ran out of descriptors first) and starts
 * opening them; 0 when none are left. */
static size_t wave_start(feeder *f, wave *v)
{
    size_t k;

    v->cand = 0;
    v->tasks = NULL;
    for (k = 0; k < f->nretry; k++)
        v->idx[v->cand++] = f->retry[k];
    f->nretry = 0;
    while (v->cand < f->w && f->next < f->n)
        v->idx[v->cand++] = f->next++;
    if (v->cand > 1 && f->openers && f->width > 1)
        v->tasks = fx_pool_spawn(f->openers, v->cand, open_one, v, f->width);
    if (!v->tasks)
        for (k = 0; k < v->cand; k++)
            open_one(v, k);
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

int fx_chunks_read(const fx_chunk *c, size_t n, char *scratch, int how, int verify,
                   uint64_t split, fx_run_fn run, void *ctx, struct fx_pool *openers,
                   int open_width, fx_chunk_result *out)
{
    feeder f = {.c = c, .n = n, .openers = openers, .width = open_width};
    size_t w;
    wave waves[2], *cur, *nxt;
    fx_op *ops = NULL;
    fx_result *res = NULL;
    char **hdrs = NULL;
    int64_t *hdr_res = NULL;
    size_t *which = NULL;
    int ret = 0, started = 0, direct = how & FX_OPEN_DIRECT;

    for (size_t k = 0; k < n; k++) {
        out[k].status = -ECANCELED;
        out[k].nbytes = 0;
        out[k].dev = out[k].ino = 0;
        out[k].size = -1;
    }
    if (n == 0)
        return 0;
    w = f.w = wave_size(n, openers && open_width > 1);
    memset(waves, 0, sizeof(waves));
    for (int j = 0; j < 2; j++) {
        waves[j].c = c;
        waves[j].out = out;
        waves[j].how = how;
        waves[j].idx = calloc(w, sizeof(size_t));
        waves[j].fds = calloc(w, sizeof(int));
    }
    ops = calloc(w, sizeof(*ops));
    res = calloc(w, sizeof(*res));
    hdrs = calloc(w, sizeof(*hdrs));
    hdr_res = calloc(w, sizeof(*hdr_res));
    which = calloc(w, sizeof(*which));
    f.retry = calloc(w, sizeof(*f.retry));
    if (!ops || !res || !hdrs || !hdr_res || !which || !f.retry || !waves[0].idx ||
        !waves[0].fds || !waves[1].idx || !waves[1].fds) {
        ret = -ENOMEM;
        goto out;
    }
    cur = &waves[0];
    nxt = &waves[1];
    started = wave_start(&f, cur) > 0;
    while (started) {
        fx_batch b;
        size_t m = 0, k;
        int r, all_mem = 1, last_mem = -1, emfile = 0;
        uint64_t last_dev = 0;

        fx_tasks_wait(openers, cur->tasks);
        cur->tasks = NULL;
        for (k = 0; k < cur->cand; k++) {
            size_t i = cur->idx[k];
            int fd = cur->fds[k];

            if (fd >= 0) {
                ops[m].fd = fd;
                ops[m].offset = FX_HDR_SIZE;
                ops[m].length = c[i].length;
                ops[m].buf = c[i].dest;
                ops[m].map = NULL;
                ops[m].map_len = 0;
                ops[m].dev = out[i].dev; /* from the fstat at its open */
                hdrs[m] = scratch + i * FX_HDR_SIZE;
                which[m++] = i;
                if (direct && all_mem)
                    all_mem = fx_fd_in_memory(fd, out[i].dev, &last_dev, &last_mem);
            } else if (fd == -EMFILE || fd == -ENFILE) {
                emfile = 1;
            } else {
                out[i].status = fd;
                out[i].nbytes = fd;
            }
        }
        /* Out of descriptors: with others open, those go again in a later
         * wave; with none open here, they fail. */
        for (k = 0; emfile && k < cur->cand; k++) {
            int fd = cur->fds[k];

            if (fd != -EMFILE && fd != -ENFILE)
                continue;
            if (m > 0) {
                f.retry[f.nretry++] = cur->idx[k];
            } else {
                out[cur->idx[k]].status = fd;
                out[cur->idx[k]].nbytes = fd;
            }
        }
        if ((how & FX_OPEN_MAP) && (!direct || all_mem))
            map_files(ops, m, which, out);
        /* The next wave opens while this one reads. */
        started = wave_start(&f, nxt) > 0;
        if (m > 0) {
            memset(&b, 0, sizeof(b));
            b.ops = ops;
            b.nops = m;
            b.res = res;
            b.want_crc = verify;
            b.stage_direct = (how & FX_OPEN_STAGE) != 0;
            b.crc_pool = openers;
            b.crc_width = open_width;
            b.hdrs = hdrs;
            b.hdr_res = hdr_res;
            b.fds_known = direct ? FX_FDS_DIRECT | (all_mem ? FX_FDS_MEM : 0) : FX_FDS_BUFFERED;
            r = fx_batch_prepare(&b, unchecked_split(split, direct && !all_mem, verify));
            if (r == 0) {
                r = run(ctx, &b);
                fx_batch_release(&b);
            }
            for (k = 0; k < m; k++) {
                size_t ci = which[k];

                if (ops[k].map)
                    munmap((void *)ops[k].map, ops[k].map_len);
                close(ops[k].fd);
                if (r < 0) {
                    out[ci].status = r;
                    out[ci].nbytes = r;
                    continue;
                }
                out[ci].nbytes = res[k].result;
                out[ci].status = check_chunk(&c[ci], (const unsigned char *)hdrs[k],
                                             hdr_res[k] == -EINPROGRESS ? -EIO : hdr_res[k],
                                             &res[k], verify);
            }
            if (r == -ENOMEM || r == -EOWNERDEAD) {
                ret = r;
                break;
            }
        }
        {
            wave *t = cur;
            cur = nxt;
            nxt = t;
        }
    }
    if (ret < 0 && started) {
        /* Stopped early: the wave being opened is waited for and closed. */
        fx_tasks_wait(openers, nxt->tasks);
        for (size_t k = 0; k < nxt->cand; k++)
            if (nxt->fds[k] >= 0)
                close(nxt->fds[k]);
    }
out:
    for (int j = 0; j < 2; j++) {
        free(waves[j].idx);
        free(waves[j].fds);
    }
    free(ops);
    free(res);
    free(hdrs);
    free(hdr_res);
    free(which);
    free(f.retry);
    return ret;
}
