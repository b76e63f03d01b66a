/* Batch bookkeeping shared by both engines: cutting operations into pieces,
 * the O_DIRECT bounce for unaligned pieces, and per-operation results. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fxio.h"

static int is_aligned(uint64_t v) { return (v & (FX_DIO_ALIGN - 1)) == 0; }

int fx_piece_needs_bounce(const fx_piece *p)
{
    return p->direct && !(is_aligned((uintptr_t)p->buf) && is_aligned(p->offset) &&
                          is_aligned(p->length));
}

int fx_batch_prepare(fx_batch *b, uint64_t split)
{
    size_t n = 0, i, k = 0;

    b->pieces = NULL;
    b->npieces = 0;
    b->prog = calloc(b->nops ? b->nops : 1, sizeof(*b->prog));
    if (!b->prog)
        return -ENOMEM;
    /* Count first so the pieces live in one allocation. An unaligned tail of
     * an O_DIRECT op gets a piece of its own so only it is bounced. */
    for (i = 0; i < b->nops; i++) {
        uint64_t len = b->ops[i].length;
        n += len ? (len + split - 1) / split + 1 : 0;
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
        int direct = 0, fl;
        uint64_t pos = 0;

        b->res[i].result = 0;
        b->res[i].crc = 0;
        if (op->length == 0)
            continue;
        fl = fcntl(op->fd, F_GETFL);
        if (fl < 0) {
            b->prog[i].err = errno; /* bad descriptor: the op fails, others go on */
            continue;
        }
        /* Positioned I/O only: a pipe or socket would block io_uring forever. */
        if (fstat(op->fd, &st) < 0) {
            b->prog[i].err = errno;
            continue;
        }
        if (!(S_ISREG(st.st_mode) || S_ISBLK(st.st_mode))) {
            b->prog[i].err = S_ISDIR(st.st_mode) ? EISDIR : ESPIPE;
            continue;
        }
        direct = (fl & O_DIRECT) != 0;
        b->prog[i].first = (uint32_t)k;
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

void fx_batch_release(fx_batch *b)
{
    free(b->pieces);
    free(b->prog);
    b->pieces = NULL;
    b->prog = NULL;
}

void fx_piece_checksum(const fx_batch *b, fx_piece *p, int64_t res)
{
    if (b->want_crc && res > 0)
        p->crc = fx_crc32c(0, p->start, (size_t)res);
}

/* Called once per piece; the caller serialises calls for one batch. */
int fx_piece_finish(fx_batch *b, fx_piece *p, int64_t res)
{
    fx_progress *pr = &b->prog[p->op];

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

/* Transfers the whole range, retrying short transfers. O_DIRECT transfers are
 * short only at EOF (reads) or when space runs out (writes), and their
 * remainder would be unaligned, so they are not retried. */
static int64_t rw_all(int write, int direct, int fd, char *buf, uint64_t len, uint64_t off)
{
    uint64_t done = 0;

    while (done < len) {
        ssize_t r = write ? pwrite(fd, buf + done, len - done, (off_t)(off + done))
                          : pread(fd, buf + done, len - done, (off_t)(off + done));
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            return -errno;
        }
        if (r == 0) {
            if (write)
                return -EIO;
            break; /* EOF */
        }
        done += (uint64_t)r;
        if (direct && done < len) {
            if (write)
                return -ENOSPC;
            break;
        }
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

int64_t fx_piece_run_sync(const fx_batch *b, fx_piece *p)
{
    int fd = b->ops[p->op].fd;

    if (fx_piece_needs_bounce(p))
        return run_bounced(b->write, fd, p);
    return rw_all(b->write, p->direct, fd, p->buf, p->length, p->offset);
}
