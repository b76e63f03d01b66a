/* Batch bookkeeping shared by both engines: cutting operations into pieces,
 * the O_DIRECT bounce for unaligned pieces, per-operation results, short
 * transfers, the fork guard and the test fault points. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "fxio.h"

/* ------------------------------------------------------------ fork guard */

_Atomic unsigned fx_fork_gen;

static void on_fork_child(void) { atomic_fetch_add(&fx_fork_gen, 1); }

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static int fork_guard_err;

static void fork_guard_install(void) { fork_guard_err = pthread_atfork(NULL, NULL, on_fork_child); }

int fx_fork_guard_init(void)
{
    pthread_once(&fork_once, fork_guard_install);
    return fork_guard_err ? -fork_guard_err : 0;
}

/* ---------------------------------------------------------- fault points */

_Atomic int fx_fault_on;
_Atomic unsigned long fx_crc_spread_runs; /* counted by the io_uring engine; 0 without it */
_Atomic unsigned long fx_uring_peak_inflight; /* most pieces one io_uring run had out at once */
_Atomic unsigned long fx_uring_sync_pieces;
_Thread_local unsigned long fx_uring_last_end;
_Atomic unsigned long fx_map_pieces, fx_map_faults, fx_staged_pieces, fx_direct_staged_pieces, fx_whole_payloads;
_Atomic unsigned long fx_helper_waves;
_Atomic int fx_chunk_one_lane;
_Atomic int fx_chunk_writes_running;
static _Atomic long fault_left[FX_FAULT_NKINDS];
static _Atomic long fault_fired[FX_FAULT_NKINDS];
static const char *const fault_names[FX_FAULT_NKINDS] = {
    [FX_FAULT_WAIT_EINTR] = "wait_eintr", [FX_FAULT_SUBMIT_FAIL] = "submit_fail",
    [FX_FAULT_EAGAIN] = "eagain",         [FX_FAULT_EINTR] = "eintr",
    [FX_FAULT_SHORT] = "short",           [FX_FAULT_MAP_TRUNCATE] = "map_truncate",
    [FX_FAULT_NO_CLONE] = "no_clone",     [FX_FAULT_MAP_CUT] = "map_cut",
};

long fx_fault_hit(int kind)
{
    long left = atomic_load(&fault_left[kind]);

    while (left > 0)
        if (atomic_compare_exchange_weak(&fault_left[kind], &left, left - 1))
            return atomic_fetch_add(&fault_fired[kind], 1) + 1;
    return 0;
}

const char *fx_fault_name(int kind) { return fault_names[kind]; }
long fx_fault_fired(int kind) { return atomic_load(&fault_fired[kind]); }

int fx_fault_setup(const char *spec, char *why, size_t whylen)
{
    long left[FX_FAULT_NKINDS] = {0};
    const char *p = spec;
    int any = 0;

    while (p && *p) {
        size_t n = strcspn(p, ":,");
        int k;
        char *end;
        long v;

        for (k = 0; k < FX_FAULT_NKINDS; k++)
            if (strlen(fault_names[k]) == n && strncmp(p, fault_names[k], n) == 0)
                break;
        if (k == FX_FAULT_NKINDS || p[n] != ':') {
            snprintf(why, whylen, "LMCACHE_FX_FAULT: expected kind:count with kind one of "
                                  "wait_eintr, submit_fail, eagain, eintr, short, map_truncate, no_clone, map_cut; got '%.*s'",
                     (int)strcspn(p, ","), p);
            return -1;
        }
        errno = 0;
        v = strtol(p + n + 1, &end, 10);
        if (errno || end == p + n + 1 || v < 0 || (*end && *end != ',')) {
            snprintf(why, whylen, "LMCACHE_FX_FAULT: bad count for %s", fault_names[k]);
            return -1;
        }
        left[k] = v;
        any |= v > 0;
        p = *end ? end + 1 : end;
    }
    atomic_store(&fx_fault_on, 0);
    for (int k = 0; k < FX_FAULT_NKINDS; k++) {
        atomic_store(&fault_left[k], left[k]);
        atomic_store(&fault_fired[k], 0);
    }
    atomic_store(&fx_fault_on, any);
    return 0;
}

int64_t fx_fault_short(int64_t res, long ordinal)
{
    int64_t keep = (res / 2) & ~(int64_t)(FX_DIO_ALIGN - 1);

    if (ordinal % 2 == 0)
        keep += 512; /* every other one ends off the 4 KiB grid */
    return keep > 0 && keep < res ? keep : res;
}

/* ----------------------------------------------------------------- batch */

static int is_aligned(uint64_t v) { return (v & (FX_DIO_ALIGN - 1)) == 0; }

int fx_piece_needs_bounce(const fx_piece *p)
{
    return p->direct && !(is_aligned((uintptr_t)p->buf) && is_aligned(p->offset) &&
                          is_aligned(p->length));
}

int fx_fd_in_memory(int fd, uint64_t dev, uint64_t *last_dev, int *last_mem)
{
    struct statfs sf;

    if (*last_dev == dev && *last_mem >= 0)
        return *last_mem;
    *last_dev = dev;
    *last_mem = fstatfs(fd, &sf) == 0 &&
                ((unsigned long)sf.f_type == 0x01021994ul /* TMPFS_MAGIC */ ||
                 (unsigned long)sf.f_type == 0x858458f6ul /* RAMFS_MAGIC */ ||
                 (unsigned long)sf.f_type == 0x958458f6ul /* HUGETLBFS_MAGIC */);
    return *last_mem;
}

int fx_batch_prepare(fx_batch *b, uint64_t split)
{
    size_t n = 0, i, k = 0;
    uint64_t last_dev = 0;
    int last_mem = -1;

    b->pieces = NULL;
    b->npieces = 0;
    b->prog = calloc(b->nops ? b->nops : 1, sizeof(*b->prog));
    if (!b->prog)
        return -ENOMEM;
    /* Count first so the pieces live in one allocation. An unaligned tail of
     * an O_DIRECT op gets a piece of its own so only it is bounced. */
    for (i = 0; i < b->nops; i++) {
        uint64_t len = b->ops[i].length, c = 0;

        /* Lengths and offsets come from the caller: no sum below may wrap,
         * and an op's piece count (c, and one more for a header) must fit
         * its uint32_t fields. */
        if (split == 0 || len > INT64_MAX || b->ops[i].offset > INT64_MAX - len ||
            (c = len ? (len + split - 1) / split + 1 : 0) + 1 > UINT32_MAX ||
            n > SIZE_MAX / sizeof(*b->pieces) - c - 1) {
            free(b->prog);
            b->prog = NULL;
            return -EINVAL;
        }
        n += c;
        if (b->hdrs && b->hdrs[i])
            n++; /* a header-only piece when it cannot ride with the first */
    }
    b->pieces = malloc((n ? n : 1) * sizeof(*b->pieces));
    if (!b->pieces) {
        free(b->prog);
        b->prog = NULL;
        return -ENOMEM;
    }
    for (i = 0; i < b->nops; i++) {
        const fx_op *op = &b->ops[i];
        struct stat st;
        int direct = 0, fl, mem;
        uint64_t pos = 0;

        char *hdr = b->hdrs && !b->write ? b->hdrs[i] : NULL;

        b->res[i].result = 0;
        b->res[i].crc = 0;
        if (b->hdr_res)
            b->hdr_res[i] = hdr ? -EINPROGRESS : 0;
        if (op->length == 0 && !hdr)
            continue;
        b->prog[i].dev = op->dev;
        if (b->fds_known) {
            direct = (b->fds_known & FX_FDS_DIRECT) != 0;
            mem = !direct || (b->fds_known & FX_FDS_MEM);
            goto checked;
        }
        fl = fcntl(op->fd, F_GETFL);
        if (fl < 0) {
            b->prog[i].err = errno; /* bad descriptor: the op fails, others go on */
            if (hdr)
                b->hdr_res[i] = -errno;
            continue;
        }
        /* Positioned I/O only: a pipe or socket would block io_uring forever. */
        if (fstat(op->fd, &st) < 0) {
            b->prog[i].err = errno;
            if (hdr)
                b->hdr_res[i] = -errno;
            continue;
        }
        if (!(S_ISREG(st.st_mode) || S_ISBLK(st.st_mode))) {
            b->prog[i].err = S_ISDIR(st.st_mode) ? EISDIR : ESPIPE;
            if (hdr)
                b->hdr_res[i] = -b->prog[i].err;
            continue;
        }
        if (!op->dev)
            b->prog[i].dev = (uint64_t)(S_ISBLK(st.st_mode) ? st.st_rdev : st.st_dev);
        direct = (fl & O_DIRECT) != 0;
        mem = !b->write && (!direct || fx_fd_in_memory(op->fd, (uint64_t)st.st_dev, &last_dev,
                                                       &last_mem));
    checked:
        mem = mem && !b->write;
        if (hdr && op->offset < FX_HDR_SIZE) {
            b->prog[i].err = EINVAL;
            b->hdr_res[i] = -EINVAL;
            continue;
        }
        b->prog[i].first = (uint32_t)k;
        if (hdr) {
            /* The header rides with the first piece in one vectored read,
             * unless that piece must be bounced (or there is none). */
            fx_piece probe = {.direct = direct, .offset = op->offset, .buf = op->buf};
            uint64_t first = op->length > split ? split : op->length;

            if (direct && first > FX_DIO_ALIGN && !is_aligned(first))
                first &= ~(uint64_t)(FX_DIO_ALIGN - 1);
            probe.length = first;
            if (op->length == 0 || fx_piece_needs_bounce(&probe) ||
                (direct && !is_aligned((uintptr_t)hdr))) {
                fx_piece *p = &b->pieces[k++];
                memset(p, 0, sizeof(*p));
                p->op = (uint32_t)i;
                p->direct = direct;
                p->offset = op->offset;
                p->buf = p->start = op->buf;
                p->hdr = hdr;
                p->mem = mem;
                b->prog[i].pending++;
                b->prog[i].count++;
                hdr = NULL;
            }
        }
        while (pos < op->length) {
            uint64_t len = op->length - pos;
            fx_piece *p;

            if (len > split)
                len = split;
            else if (direct && len > FX_DIO_ALIGN && !is_aligned(len))
                len &= ~(uint64_t)(FX_DIO_ALIGN - 1);
            p = &b->pieces[k++];
            p->op = (uint32_t)i;
            p->direct = direct;
            p->offset = op->offset + pos;
            p->length = len;
            p->buf = p->start = op->buf + pos;
            p->done = 0;
            p->crc = 0;
            p->retries = 0;
            p->hdr = hdr;
            p->mem = mem;
            p->summed = 0;
            p->stage = NULL;
            hdr = NULL;
            b->prog[i].pending++;
            b->prog[i].count++;
            pos += len;
        }
    }
    b->npieces = k;
    for (i = 0; i < b->nops; i++)
        if (b->prog[i].pending == 0)
            fx_op_complete(b, i); /* empty op or bad descriptor */
    return 0;
}

/* The order a read's pieces are queued in: round-robin over the devices
 * its ops' files lie on, each device's pieces in op order, rather than op
 * by op. A chunk file lies on one device, and a read holds only so many
 * pieces in flight (queue_depth slots, and 8 staged pieces): queued op by op,
 * those were all one chunk's, so a store striped over eight devices kept
 * under one read in flight per device and the others idle
 * (scripts/inflight_probe.py). Round-robin, a window of pieces spans every
 * device the read touches, and each device still reads its chunks one
 * after another. A read on one device keeps its order: nothing to spread.
 * The device is fx_progress.dev: the filesystem's (st_dev), or for a block
 * device file the device itself (st_rdev), from the fstat fx_batch_prepare
 * makes or the caller's (the chunk path's own); an unknown one (0) counts
 * as one device. *ndevs: the devices the read touches (1 for a write, at
 * most ORDER_DEVS_MAX), for what else scales with them (staged pieces in
 * flight). NULL when the order would not change (one device, one op, a
 * write), on more than ORDER_DEVS_MAX devices, or on no memory.
 * fx_piece_order_ops (LMCACHE_FX_PIECE_ORDER=ops at load, or
 * _fxio._set_piece_order) keeps op order everywhere, for probes and tests:
 * a flag, not a getenv per batch, since Python may change the environment
 * while an engine thread reads it. */
#define ORDER_DEVS_MAX 64

_Atomic int fx_piece_order_ops;

size_t *fx_piece_order(const fx_batch *b, unsigned *ndevs)
{
    uint64_t devs[ORDER_DEVS_MAX];
    size_t cnt[ORDER_DEVS_MAX] = {0}, off[ORDER_DEVS_MAX], pos[ORDER_DEVS_MAX] = {0};
    size_t ndev = 0, total = 0, k = 0, most = 0, *grouped = NULL, *order = NULL;
    unsigned char *dev_of;

    *ndevs = 1;
    if (b->write || b->nops < 2)
        return NULL;
    dev_of = malloc(b->nops);
    if (!dev_of)
        return NULL;
    for (size_t i = 0; i < b->nops; i++) {
        uint64_t dev = b->prog[i].dev;
        size_t d;

        dev_of[i] = 0;
        if (b->prog[i].count == 0)
            continue;
        for (d = 0; d < ndev && devs[d] != dev; d++)
            ;
        if (d == ndev) {
            if (ndev == ORDER_DEVS_MAX)
                goto keep;
            devs[ndev++] = dev;
            *ndevs = (unsigned)ndev;
        }
        dev_of[i] = (unsigned char)d;
        cnt[d] += b->prog[i].count;
        total += b->prog[i].count;
    }
    if (ndev < 2 || total != b->npieces || atomic_load_explicit(&fx_piece_order_ops, memory_order_relaxed))
        goto keep;
    grouped = malloc(total * sizeof(*grouped));
    order = malloc(total * sizeof(*order));
    if (!grouped || !order)
        goto keep;
    for (size_t d = 0, at = 0; d < ndev; d++) {
        off[d] = at;
        at += cnt[d];
        if (cnt[d] > most)
            most = cnt[d];
    }
    for (size_t i = 0; i < b->nops; i++)
        for (uint32_t r = 0; r < b->prog[i].count; r++)
            grouped[off[dev_of[i]] + pos[dev_of[i]]++] = b->prog[i].first + r;
    for (size_t r = 0; r < most; r++)
        for (size_t d = 0; d < ndev; d++)
            if (r < cnt[d])
                order[k++] = grouped[off[d] + r];
    free(grouped);
    free(dev_of);
    return order;
keep:
    free(grouped);
    free(order);
    free(dev_of);
    return NULL;
}

void fx_batch_fail_all(fx_batch *b, int err)
{
    for (size_t i = 0; i < b->nops; i++)
        if (b->prog[i].pending) {
            b->prog[i].pending = 0;
            b->res[i].result = -err;
            if (b->hdr_res && b->hdr_res[i] == -EINPROGRESS)
                b->hdr_res[i] = -err;
        }
}

void fx_piece_header_done(const fx_batch *b, fx_piece *p, int64_t res)
{
    if (p->hdr) {
        b->hdr_res[p->op] = res;
        p->hdr = NULL;
    }
}

void fx_batch_release(fx_batch *b)
{
    free(b->pieces);
    free(b->prog);
    b->pieces = NULL;
    b->prog = NULL;
}

void fx_piece_checksum(const fx_batch *b, fx_piece *p, int64_t res)
{
    if (p->stage) {
        /* Its bytes are in the staging slot, still in cache: moved on and
         * summed in one pass. */
        if (res > 0)
            p->crc = fx_crc32c_copy(0, p->start, p->stage, (size_t)res);
        return;
    }
    if (b->want_crc && res > 0 && !p->summed)
        p->crc = fx_crc32c(0, p->start, (size_t)res);
}

/* Called once per piece; the caller serialises calls for one batch. */
int fx_piece_finish(fx_batch *b, fx_piece *p, int64_t res)
{
    fx_progress *pr = &b->prog[p->op];

    /* A header never read in: the error (abort, fork), or -EIO. */
    fx_piece_header_done(b, p, res < 0 ? res : -EIO);
    p->done = res > 0 ? (uint64_t)res : 0;
    if (res < 0) {
        if (!pr->err)
            pr->err = (int)-res;
    } else {
        pr->bytes += (uint64_t)res;
    }
    return --pr->pending == 0;
}

/* Sets the op's final result; safe without a lock once its last piece ended. */
void fx_op_complete(fx_batch *b, size_t i)
{
    fx_progress *pr = &b->prog[i];
    fx_result *r = &b->res[i];

    if (pr->err) {
        r->result = -pr->err;
        return;
    }
    r->result = (int64_t)pr->bytes;
    if (b->want_crc) {
        /* Pieces were checksummed as they landed; join them in file order.
         * Pieces after an EOF have no bytes and leave the CRC as it is. */
        uint32_t crc = 0;
        for (uint32_t k = pr->first; k < pr->first + pr->count; k++)
            crc = fx_crc32c_combine(crc, b->pieces[k].crc, b->pieces[k].done);
        r->crc = crc;
    }
}

/* Size of a regular file or block device; 0 or -errno. */
static int fd_size(int fd, uint64_t *size)
{
    struct stat st;

    if (fstat(fd, &st) < 0)
        return -errno;
    if (S_ISBLK(st.st_mode))
        return ioctl(fd, BLKGETSIZE64, size) < 0 ? -errno : 0;
    *size = (uint64_t)st.st_size;
    return 0;
}

/* A short read is not the end of the file unless the file says so: buffered
 * reads just go on (a later read of 0 bytes is the end); O_DIRECT reads go on
 * from the aligned position at or below where they stopped, unless they
 * stopped off the grid at or past the file's size (how O_DIRECT ends). */
int64_t fx_short_keep(int write, int direct, int fd, uint64_t pos, uint64_t got)
{
    uint64_t size;

    if (write || !direct || ((pos + got) & (FX_DIO_ALIGN - 1)) == 0)
        return (int64_t)got;
    if (fd_size(fd, &size) == 0 && pos + got >= size)
        return -1;
    return (int64_t)(got & ~(uint64_t)(FX_DIO_ALIGN - 1));
}

int fx_hdr_at_eof(int fd, uint64_t pos, uint64_t got)
{
    uint64_t size;

    return fd_size(fd, &size) == 0 && pos + got >= size;
}

/* pread/pwrite with the fault points; a header ahead (fused piece): preadv
 * of the header then the piece's bytes. */
static ssize_t rw_once_hdr(int write, int fd, char *hdr, char *buf, uint64_t len, uint64_t off)
{
    ssize_t r;
    long k;

    if (__builtin_expect(fx_fault_on, 0)) {
        if (fx_fault_hit(FX_FAULT_EINTR)) {
            errno = EINTR;
            return -1;
        }
        if (fx_fault_hit(FX_FAULT_EAGAIN)) {
            errno = EAGAIN;
            return -1;
        }
    }
    if (hdr) {
        struct iovec iov[2] = {{hdr, FX_HDR_SIZE}, {buf, len}};
        r = write ? pwritev(fd, iov, len ? 2 : 1, (off_t)(off - FX_HDR_SIZE))
                  : preadv(fd, iov, len ? 2 : 1, (off_t)(off - FX_HDR_SIZE));
    } else {
        r = write ? pwrite(fd, buf, len, (off_t)off) : pread(fd, buf, len, (off_t)off);
    }
    if (__builtin_expect(fx_fault_on, 0) && r > 0 && !write && (k = fx_fault_hit(FX_FAULT_SHORT)))
        r = (ssize_t)fx_fault_short(r, k);
    return r;
}

static ssize_t rw_once(int write, int fd, char *buf, uint64_t len, uint64_t off)
{
    return rw_once_hdr(write, fd, NULL, buf, len, off);
}

/* Transfers the whole range. EINTR, EAGAIN and short transfers are retried up
 * to FX_RETRY_MAX times (then -errno, or -EIO for a short transfer); a read
 * of 0 bytes is the end of the file. A short O_DIRECT write of whole blocks
 * goes on from where it stopped (the kernel caps one write at 0x7ffff000
 * bytes; where the room or a file size limit ran out, the next write says
 * so: ENOSPC, EFBIG); one of a part block means the space ran out. */
static int64_t rw_all(int write, int direct, int fd, char *buf, uint64_t len, uint64_t off)
{
    uint64_t done = 0;
    unsigned retries = 0;

    while (done < len) {
        ssize_t r = rw_once(write, fd, buf + done, len - done, off + done);
        int64_t keep;

        if (r < 0) {
            if ((errno == EINTR || errno == EAGAIN) && retries++ < FX_RETRY_MAX)
                continue;
            return -errno;
        }
        if (r == 0) {
            if (write)
                return -EIO;
            break; /* EOF */
        }
        if ((uint64_t)r >= len - done) {
            done = len;
            break;
        }
        if (write && direct) {
            if ((uint64_t)r % FX_DIO_ALIGN)
                return -ENOSPC;
            done += (uint64_t)r; /* progress every time: no retry counted */
            continue;
        }
        keep = fx_short_keep(write, direct, fd, off + done, (uint64_t)r);
        if (keep < 0) {
            done += (uint64_t)r; /* O_DIRECT read that ended at EOF */
            break;
        }
        if (retries++ >= FX_RETRY_MAX)
            return -EIO;
        done += (uint64_t)keep;
    }
    return (int64_t)done;
}

/* O_DIRECT with an unaligned buffer, offset or length goes through an aligned
 * bounce buffer. Reads widen the range to blocks and copy back only what was
 * asked; writes pad with zeros to the block (the store trims the file after)
 * and need an aligned offset. */
static int64_t run_bounced(int write, int fd, const fx_piece *p)
{
    uint64_t start = p->offset & ~(uint64_t)(FX_DIO_ALIGN - 1);
    uint64_t skip = p->offset - start;
    uint64_t alen = (skip + p->length + FX_DIO_ALIGN - 1) & ~(uint64_t)(FX_DIO_ALIGN - 1);
    void *tmp = NULL;
    int64_t r;

    if (write && skip)
        return -EINVAL;
    if (posix_memalign(&tmp, FX_DIO_ALIGN, alen))
        return -ENOMEM;
    if (write) {
        memcpy(tmp, p->buf, p->length);
        memset((char *)tmp + p->length, 0, alen - p->length);
    }
    r = rw_all(write, 1, fd, tmp, alen, start);
    if (r >= 0) {
        r = r > (int64_t)skip ? r - (int64_t)skip : 0;
        if (r > (int64_t)p->length)
            r = (int64_t)p->length;
        if (!write && r > 0)
            memcpy(p->buf, (char *)tmp + skip, (size_t)r);
    }
    free(tmp);
    return r;
}

/* A fused piece: header and the piece's bytes in one preadv, then whatever
 * is left of the piece as a plain read. Sets the header's result. */
static int64_t run_fused(const fx_batch *b, fx_piece *p, int fd)
{
    unsigned retries = 0;

    for (;;) {
        ssize_t r = rw_once_hdr(0, fd, p->hdr, p->buf, p->length, p->offset);
        uint64_t got;
        int64_t keep, rest;

        if (r < 0) {
            if ((errno == EINTR || errno == EAGAIN) && retries++ < FX_RETRY_MAX)
                continue;
            fx_piece_header_done(b, p, -errno);
            return -errno;
        }
        if (r < (ssize_t)FX_HDR_SIZE) {
            if (r == 0 || fx_hdr_at_eof(fd, p->offset - FX_HDR_SIZE, (uint64_t)r)) {
                fx_piece_header_done(b, p, r); /* the file ends inside its header */
                return 0;
            }
            if (retries++ >= FX_RETRY_MAX) {
                fx_piece_header_done(b, p, -EIO);
                return -EIO;
            }
            continue; /* read the whole again */
        }
        fx_piece_header_done(b, p, FX_HDR_SIZE);
        got = (uint64_t)r - FX_HDR_SIZE;
        if (got >= p->length)
            return (int64_t)p->length;
        keep = got ? fx_short_keep(0, p->direct, fd, p->offset, got) : 0;
        if (keep < 0)
            return (int64_t)got; /* O_DIRECT read that ended at EOF */
        rest = rw_all(0, p->direct, fd, p->buf + keep, p->length - (uint64_t)keep,
                      p->offset + (uint64_t)keep);
        return rest < 0 ? rest : keep + rest;
    }
}

int64_t fx_write_fused(int fd, char *hdr, const char *src, uint64_t len)
{
    unsigned retries = 0;

    for (;;) {
        ssize_t r = rw_once_hdr(1, fd, hdr, (char *)src, len, FX_HDR_SIZE);

        if (r < 0) {
            if ((errno == EINTR || errno == EAGAIN) && retries++ < FX_RETRY_MAX)
                continue;
            return -errno;
        }
        if ((uint64_t)r == FX_HDR_SIZE + len)
            return (int64_t)len;
        if (r > 0 && (uint64_t)r % FX_DIO_ALIGN == 0) { /* whole blocks (the header at least): the rest as rw_all */
            int64_t rest = rw_all(1, 1, fd, (char *)src + (r - FX_HDR_SIZE), len - (uint64_t)(r - FX_HDR_SIZE),
                                  (uint64_t)r);
            return rest < 0 ? rest : (int64_t)len;
        }
        return r == 0 ? -EIO : -ENOSPC; /* short by a part block on O_DIRECT: no room, as in rw_all */
    }
}

/* The map_truncate fault: the file of fd cut to its header (whole pages
 * go: the copy faults); map_cut: its last byte cut off (inside a page: the
 * copy reads a zero there, no fault). Through a writable descriptor of its
 * own (fd is read-only). */
static void cut_file(int fd, int to_header)
{
    char path[64];
    struct stat st;
    int w;

    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    if ((w = open(path, O_WRONLY | O_CLOEXEC)) >= 0) {
        off_t to = FX_HDR_SIZE;

        if (!to_header)
            to = fstat(w, &st) == 0 && st.st_size > 0 ? st.st_size - 1 : 0;
        if (ftruncate(w, to) < 0)
            perror("lmcache-fx: map_truncate or map_cut fault");
        close(w);
    }
}

/* A piece inside its op's mapping, copied (and summed) from it; -EFAULT
 * when it faulted or lies outside: then it is read as any other. */
static int64_t run_mapped(const fx_batch *b, fx_piece *p)
{
    const fx_op *op = &b->ops[p->op];
    const char *lo = op->map, *hi = op->map + op->map_len;
    uint64_t from = p->hdr ? p->offset - FX_HDR_SIZE : p->offset;
    uint32_t crc = 0;
    int64_t r;

    if (p->offset + p->length > op->map_len || from > p->offset)
        return -EFAULT;
    if (FX_FAULT(FX_FAULT_MAP_TRUNCATE))
        cut_file(op->fd, 1);
    else if (FX_FAULT(FX_FAULT_MAP_CUT))
        cut_file(op->fd, 0);
    if ((p->hdr && fx_map_copy(p->hdr, lo + from, FX_HDR_SIZE, lo, hi, 0, &crc) < 0) ||
        (r = fx_map_copy(p->buf, lo + p->offset, p->length, lo, hi, b->want_crc, &crc)) < 0) {
        fx_map_faults++;
        return -EFAULT;
    }
    fx_map_pieces++;
    if (p->hdr)
        fx_piece_header_done(b, p, FX_HDR_SIZE);
    p->crc = crc;
    p->summed = b->want_crc;
    return r;
}

/* Reads from memory (the page cache, tmpfs) that want a CRC32C are staged:
 * read() in stretches of FX_STAGE_BYTES into a buffer of this thread's that
 * stays in its cache, then copied on with the one-pass copy and sum, whose
 * streaming stores spare the destination's read for ownership. Against a
 * read() into the destination and a sum of it, that is one pass over memory
 * fewer (docs/benchmarks.md, "Staged reads"). Only where the copy is one pass,
 * and for pieces of at least FX_STAGE_MIN bytes. */
#define FX_STAGE_BYTES (256u << 10)
#define FX_STAGE_MIN (64u << 10)

static pthread_key_t stage_key;
static pthread_once_t stage_once = PTHREAD_ONCE_INIT;
static int stage_key_ok;

static void stage_key_init(void) { stage_key_ok = pthread_key_create(&stage_key, free) == 0; }

/* This thread's staging buffer, or NULL (none to be had: read directly). */
static char *stage_buffer(void)
{
    void *buf;

    pthread_once(&stage_once, stage_key_init);
    if (!stage_key_ok)
        return NULL;
    if ((buf = pthread_getspecific(stage_key)))
        return buf;
    if (posix_memalign(&buf, FX_DIO_ALIGN, FX_STAGE_BYTES))
        return NULL;
    if (pthread_setspecific(stage_key, buf)) {
        free(buf);
        return NULL;
    }
    return buf;
}

static int stages(const fx_batch *b, const fx_piece *p)
{
    return b->staged && !b->write && b->want_crc && p->mem && p->length >= FX_STAGE_MIN &&
           !fx_piece_needs_bounce(p) && fx_crc32c_copy_one_pass();
}

/* A staged piece through stage (FX_STAGE_BYTES); EOF and errors as rw_all,
 * the header of a fused piece with its first stretch, as run_fused. */
static int64_t run_staged(const fx_batch *b, fx_piece *p, int fd, char *stage)
{
    uint64_t done = 0;
    uint32_t crc = 0;

    while (done < p->length) {
        uint64_t n = p->length - done < FX_STAGE_BYTES ? p->length - done : FX_STAGE_BYTES;
        int64_t r;

        if (p->hdr) { /* the header and the first stretch in one vectored read */
            fx_piece first = *p;

            first.buf = stage;
            first.length = n;
            r = run_fused(b, &first, fd);
            p->hdr = NULL; /* its result is recorded */
        } else {
            r = rw_all(0, p->direct, fd, stage, n, p->offset + done);
        }
        if (r < 0)
            return r;
        crc = fx_crc32c_copy(crc, p->buf + done, stage, (size_t)r);
        done += (uint64_t)r;
        if ((uint64_t)r < n)
            break; /* the end of the file */
    }
    p->crc = crc;
    p->summed = 1;
    fx_staged_pieces++;
    return (int64_t)done;
}

int64_t fx_piece_run_sync(const fx_batch *b, fx_piece *p)
{
    int fd = b->ops[p->op].fd;

    if (fx_batch_stopped(b))
        return -ECANCELED;
    if (b->ops[p->op].map && !b->write) {
        int64_t r = run_mapped(b, p);

        if (r >= 0)
            return r;
    }
    if (stages(b, p)) {
        char *stage = stage_buffer();

        if (stage)
            return run_staged(b, p, fd, stage);
    }
    if (p->hdr)
        return run_fused(b, p, fd);
    if (fx_piece_needs_bounce(p))
        return run_bounced(b->write, fd, p);
    return rw_all(b->write, p->direct, fd, p->buf, p->length, p->offset);
}

int64_t fx_io_sync(int fd, int write, int direct, char *buf, uint64_t len, uint64_t off)
{
    fx_piece p;

    memset(&p, 0, sizeof(p));
    p.direct = direct;
    p.offset = off;
    p.length = len;
    p.buf = p.start = buf;
    if (fx_piece_needs_bounce(&p))
        return run_bounced(write, fd, &p);
    return rw_all(write, direct, fd, buf, len, off);
}
