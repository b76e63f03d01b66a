/* io_uring rings: setup with one fallback ladder, and submit / reap in the
 * spirit of fio's queue / commit / getevents (declared in fxio.h). The batch
 * runner (uring_engine.c) and the GPU pipeline (gpu.c) drive rings only
 * through these calls, so the setup flags, the fault points and the retry
 * ladder of a wait are in one place. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ring.h"

#ifdef FX_HAVE_LIBURING

/* Optional setup flags, best first; each refused one (EINVAL: an older
 * kernel) is dropped in turn, down to none. */
static const unsigned setup_ladder[] = {
#ifdef IORING_SETUP_COOP_TASKRUN
    IORING_SETUP_COOP_TASKRUN, /* completions are reaped by the submitter: no IPIs */
#endif
    0,
};

fx_ring *fx_ring_new(unsigned entries, unsigned iowq_max, int *err)
{
    fx_ring *r = calloc(1, sizeof(*r));
    unsigned flags = 0;
    int e = -EINVAL;

    if (!r) {
        *err = -ENOMEM;
        return NULL;
    }
    for (size_t i = 0; i < sizeof(setup_ladder) / sizeof(setup_ladder[0]); i++)
        flags |= setup_ladder[i];
    for (size_t i = 0;; i++) {
        struct io_uring_params p;

        memset(&p, 0, sizeof(p));
        p.flags = flags;
        e = io_uring_queue_init_params(entries, &r->ring, &p);
        if (e != -EINVAL || !flags || i >= sizeof(setup_ladder) / sizeof(setup_ladder[0]))
            break;
        flags &= ~setup_ladder[i];
    }
    if (e < 0) {
        free(r);
        *err = e;
        return NULL;
    }
    (void)io_uring_ring_dontfork(&r->ring); /* a forked child gets no copy of the rings */
    if (iowq_max) {
        unsigned v[2] = {iowq_max < entries ? iowq_max : entries, 0}; /* bounded (file I/O) */
        (void)io_uring_register_iowq_max_workers(&r->ring, v);         /* 5.15+; best effort */
    }
    r->entries = entries;
    r->flags = flags;
    r->gen = fx_fork_gen;
    return r;
}

/* One NOP submitted and reaped: a ring that can be set up may still be
 * unusable (a seccomp profile that allows io_uring_setup but refuses
 * io_uring_enter), and then every read would fail instead of falling back.
 * 0, or -errno. A ring of fx_ring_new, nothing queued on it yet. */
int fx_ring_works(fx_ring *r0)
{
    struct io_uring *ring = &r0->ring;
    struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
    struct io_uring_cqe *cqe;
    int r;

    if (!sqe)
        return -EBUSY;
    io_uring_prep_nop(sqe);
    io_uring_sqe_set_data64(sqe, 0);
    do
        r = io_uring_submit_and_wait(ring, 1);
    while (r == -EINTR);
    if (r < 0)
        return r;
    if ((r = io_uring_peek_cqe(ring, &cqe)) < 0)
        return r;
    r = cqe->res;
    io_uring_cqe_seen(ring, cqe);
    return r < 0 ? r : 0;
}

void fx_ring_discard(fx_ring *r)
{
    if (!r)
        return;
    io_uring_queue_exit(&r->ring);
    free(r);
}

int fx_ring_free(fx_ring *r)
{
    if (!r)
        return 0;
    if (r->inflight)
        return -EBUSY;
    fx_ring_discard(r);
    return 0;
}

int fx_ring_register_buffers(fx_ring *r, const struct iovec *iov, unsigned n)
{
    return io_uring_register_buffers(&r->ring, iov, n);
}

unsigned fx_ring_unqueue(fx_ring *r)
{
    unsigned q = r->queued;

    r->queued = 0;
    return q;
}

unsigned fx_ring_inflight(const fx_ring *r) { return r->inflight; }
unsigned fx_ring_queued(const fx_ring *r) { return r->queued; }

int fx_ring_queue(fx_ring *r, const fx_io *io)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);

    if (!sqe)
        return -EBUSY;
    if (io->iov)
        io->write ? io_uring_prep_writev(sqe, io->fd, io->iov, io->niov, io->off)
                  : io_uring_prep_readv(sqe, io->fd, io->iov, io->niov, io->off);
    else if (io->fixed >= 0)
        io->write ? io_uring_prep_write_fixed(sqe, io->fd, io->buf, (unsigned)io->len, io->off, io->fixed)
                  : io_uring_prep_read_fixed(sqe, io->fd, io->buf, (unsigned)io->len, io->off, io->fixed);
    else
        io->write ? io_uring_prep_write(sqe, io->fd, io->buf, (unsigned)io->len, io->off)
                  : io_uring_prep_read(sqe, io->fd, io->buf, (unsigned)io->len, io->off);
    if (io->async)
        io_uring_sqe_set_flags(sqe, IOSQE_ASYNC);
    io_uring_sqe_set_data(sqe, io->tag);
    r->queued++;
    return 0;
}

/* Accounts for what the kernel took; 0, or -errno when the ring failed. */
static int took(fx_ring *r, int n)
{
    if (n > 0) {
        unsigned k = (unsigned)n > r->queued ? r->queued : (unsigned)n;
        r->queued -= k;
        r->inflight += k;
        return 0;
    }
    return n < 0 && n != -EINTR && n != -EAGAIN && n != -EBUSY ? n : 0;
}

int fx_ring_commit(fx_ring *r)
{
    if (!r->queued)
        return 0;
    if (FX_FAULT(FX_FAULT_SUBMIT_FAIL)) {
        (void)took(r, io_uring_submit(&r->ring)); /* in flight now, and the ring "failed" */
        return -EIO;
    }
    return took(r, io_uring_submit(&r->ring));
}

static int harvest(fx_ring *r, fx_event *ev, unsigned max)
{
    struct io_uring_cqe *cqe;
    unsigned head, seen = 0, n = 0;

    io_uring_for_each_cqe(&r->ring, head, cqe)
    {
        if (n == max)
            break;
        seen++;
#ifdef LIBURING_UDATA_TIMEOUT
        if (cqe->user_data == LIBURING_UDATA_TIMEOUT)
            continue; /* liburing's own timeout on kernels without EXT_ARG */
#endif
        ev[n].tag = io_uring_cqe_get_data(cqe);
        ev[n].res = cqe->res;
        n++;
    }
    io_uring_cq_advance(&r->ring, seen);
    r->inflight -= n < r->inflight ? n : r->inflight;
    return (int)n;
}

int fx_ring_getevents(fx_ring *r, fx_event *ev, unsigned max, long timeout_us)
{
    const struct timespec pause = {0, 1000000};
    int n, e;

    /* Blocking with entries queued: submit and wait in one call. */
    if (timeout_us < 0 && r->queued && !fx_fault_on) {
        e = took(r, io_uring_submit_and_wait(&r->ring, 1));
        if (e < 0)
            return e;
    } else if ((e = fx_ring_commit(r)) < 0) {
        return e;
    }
    for (;;) {
        struct io_uring_cqe *cqe = NULL;
        int intr = r->inflight && FX_FAULT(FX_FAULT_WAIT_EINTR); /* tests: a signal arrived */

        if ((n = harvest(r, ev, max)) > 0 || !r->inflight)
            return n;
        if (intr) {
            e = -EINTR; /* tests: a signal arrived */
        } else if (timeout_us < 0 && !r->queued) {
            e = io_uring_wait_cqe(&r->ring, &cqe);
        } else {
            /* Entries the kernel did not take yet are not in flight: a
             * blocking wait could outlast every completion. */
            long us = timeout_us < 0 ? 1000 : timeout_us;
            struct __kernel_timespec ts = {.tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000};
            e = io_uring_wait_cqe_timeout(&r->ring, &cqe, &ts);
        }
        if (e < 0 && e != -ETIME && e != -EINTR && e != -EAGAIN && e != -EBUSY &&
            (io_uring_peek_cqe(&r->ring, &cqe) != 0 || !cqe))
            nanosleep(&pause, NULL);
        if (timeout_us >= 0)
            return harvest(r, ev, max);
        if (r->queued && (e = fx_ring_commit(r)) < 0)
            return e;
    }
}

#else /* built without liburing */

fx_ring *fx_ring_new(unsigned entries, unsigned iowq_max, int *err)
{
    (void)entries;
    (void)iowq_max;
    *err = -ENOSYS;
    return NULL;
}
int fx_ring_free(fx_ring *r) { return r ? -ENOSYS : 0; }
void fx_ring_discard(fx_ring *r) { (void)r; }
int fx_ring_works(fx_ring *r) { return r ? -ENOSYS : 0; }
int fx_ring_register_buffers(fx_ring *r, const struct iovec *iov, unsigned n)
{
    (void)r;
    (void)iov;
    (void)n;
    return -ENOSYS;
}
unsigned fx_ring_inflight(const fx_ring *r)
{
    (void)r;
    return 0;
}
unsigned fx_ring_unqueue(fx_ring *r)
{
    (void)r;
    return 0;
}
unsigned fx_ring_queued(const fx_ring *r)
{
    (void)r;
    return 0;
}
int fx_ring_queue(fx_ring *r, const fx_io *io)
{
    (void)r;
    (void)io;
    return -ENOSYS;
}
int fx_ring_commit(fx_ring *r)
{
    (void)r;
    return -ENOSYS;
}
int fx_ring_getevents(fx_ring *r, fx_event *ev, unsigned max, long timeout_us)
{
    (void)r;
    (void)ev;
    (void)max;
    (void)timeout_us;
    return -ENOSYS;
}
#endif
