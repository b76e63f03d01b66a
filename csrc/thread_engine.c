/* The thread engine: a pool of pthreads doing pread/pwrite on pieces. Used
 * when io_uring cannot be had (old kernel, io_uring_disabled, a seccomp
 * profile) or when asked for. Plain C threads, so no GIL convoy. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <time.h>

#include "fxio.h"

typedef struct fx_job {
    struct fx_tq *tq; /* a submit/reap queue (pieces come and go), or: */
    fx_batch *b;     /* a batch of pieces, or NULL for tasks: */
    fx_task_fn fn;   /* fn(ctx, i) for i in 0..ntasks-1 */
    void *ctx;
    size_t ntasks;
    size_t next;     /* next piece to hand out */
    size_t finished; /* pieces done */
    int active;      /* workers on this job, bounded by queue depth */
    int max_active;
    pthread_cond_t done_cv;
    struct fx_job *link;
} fx_job;

struct fx_pool {
    pthread_mutex_t mu;
    pthread_cond_t work_cv;
    fx_job *head, *tail;
    int stop;
    int nthreads;
    pthread_t *threads;
    unsigned gen; /* process generation it was made in (fork guard) */
};

static size_t job_count(const fx_job *j) { return j->b ? j->b->npieces : j->ntasks; }

/* One I/O queued on a pool (fx_tq_queue) and what runs after it. */
typedef struct {
    fx_io io;
    fx_tq_after after;
    void *actx;
} tq_item;

/* A submit/reap queue on a pool's threads: its job is linked into the
 * pool's list while it has I/O waiting, so batches, tasks and queues share
 * the threads in arrival order. */
struct fx_tq {
    fx_pool *pool;
    fx_job job;
    tq_item *work; /* FIFO of I/O to run, under pool->mu */
    unsigned wh, wn, cap;
    int linked;
    pthread_mutex_t mu; /* completions */
    pthread_cond_t cv;
    fx_event *done;
    unsigned dh, dn;
    unsigned outstanding; /* queued, running or done and not reaped (under mu) */
};

static int job_has_work(const fx_job *j)
{
    return j->tq ? j->tq->wn > 0 : j->next < job_count(j);
}

/* First queued job that still has pieces and room for another worker. */
static fx_job *pick(fx_pool *pool)
{
    for (fx_job *j = pool->head; j; j = j->link)
        if (job_has_work(j) && j->active < j->max_active)
            return j;
    return NULL;
}

static void unlink_job(fx_pool *pool, fx_job *job)
{
    fx_job **pp = &pool->head, *prev = NULL;

    while (*pp && *pp != job) {
        prev = *pp;
        pp = &(*pp)->link;
    }
    if (!*pp)
        return;
    *pp = job->link;
    if (pool->tail == job)
        pool->tail = prev;
    job->link = NULL;
}

/* Pieces of at most SMALL_PIECE bytes (a small chunk's whole file, header
 * included) are handed out up to SMALL_TAKE at a time, within a fair share
 * of what is left: per piece, a lock round and a wake-up cost about what a
 * 4 KiB chunk's copy from memory does. Larger pieces go one at a time. */
#define SMALL_PIECE (64u << 10)
#define SMALL_TAKE 8

static int small_piece(const fx_piece *p) { return p->length + (p->hdr ? FX_HDR_SIZE : 0) <= SMALL_PIECE; }

static size_t small_take(const fx_pool *pool, const fx_batch *b, size_t first)
{
    size_t fair = (b->npieces - first) / (2 * (size_t)pool->nthreads), take = 1;

    if (!small_piece(&b->pieces[first]))
        return 1;
    while (take < SMALL_TAKE && take < fair && small_piece(&b->pieces[first + take]))
        take++;
    return take;
}

static void *worker(void *arg)
{
    fx_pool *pool = arg;

    pthread_setname_np(pthread_self(), "fx-io");
    pthread_mutex_lock(&pool->mu);
    for (;;) {
        fx_job *job;
        fx_piece *p;
        int64_t r, res[SMALL_TAKE];
        size_t take;
        int op_done;

        while (!pool->stop && !(job = pick(pool)))
            pthread_cond_wait(&pool->work_cv, &pool->mu);
        if (pool->stop)
            break;
        if (job->tq) {
            struct fx_tq *q = job->tq;
            tq_item it = q->work[q->wh];

            q->wh = (q->wh + 1) % q->cap;
            if (--q->wn == 0) {
                unlink_job(pool, job);
                q->linked = 0;
            }
            job->active++;
            pthread_mutex_unlock(&pool->mu);
            r = fx_io_sync(it.io.fd, it.io.write, it.io.direct, it.io.buf, it.io.len, it.io.off);
            if (it.after)
                it.after(it.actx, it.io.tag, r); /* in parallel across workers (a CRC, say) */
            pthread_mutex_lock(&pool->mu);
            job->active--;
            if (q->wn)
                pthread_cond_signal(&pool->work_cv);
            pthread_mutex_unlock(&pool->mu);
            /* The last touch of q: once its event is reaped, fx_tq_free may free it. */
            pthread_mutex_lock(&q->mu);
            q->done[(q->dh + q->dn) % q->cap] = (fx_event){.tag = it.io.tag, .res = (int)r};
            q->dn++;
            pthread_cond_signal(&q->cv);
            pthread_mutex_unlock(&q->mu);
            pthread_mutex_lock(&pool->mu);
            continue;
        }
        if (!job->b) {
            /* Tasks are small (an open): take a few at a time. */
            size_t t = job->next, take = (job->ntasks - t) / ((size_t)job->max_active * 2);

            take = take < 1 ? 1 : take > 8 ? 8 : take;
            job->next += take;
            job->active++;
            if (job->next == job->ntasks)
                unlink_job(pool, job);
            pthread_mutex_unlock(&pool->mu);
            for (size_t e = t + take; t < e; t++)
                job->fn(job->ctx, t);
            pthread_mutex_lock(&pool->mu);
            job->active--;
            job->finished += take;
            if (job->finished == job->ntasks)
                pthread_cond_signal(&job->done_cv);
            else if (job->next < job->ntasks)
                pthread_cond_signal(&pool->work_cv);
            continue;
        }
        p = &job->b->pieces[job->next];
        take = small_take(pool, job->b, job->next);
        job->next += take;
        job->active++;
        if (job->next == job->b->npieces)
            unlink_job(pool, job); /* fully handed out */
        pthread_mutex_unlock(&pool->mu);

        for (size_t k = 0; k < take; k++) {
            res[k] = fx_piece_run_sync(job->b, &p[k]);
            fx_piece_checksum(job->b, &p[k], res[k]); /* in parallel across workers */
        }

        pthread_mutex_lock(&pool->mu);
        for (size_t k = 0; k < take; k++) {
            op_done = fx_piece_finish(job->b, &p[k], res[k]);
            if (op_done)
                fx_op_complete(job->b, p[k].op); /* cheap: joins piece CRCs */
        }
        job->active--;
        if ((job->finished += take) == job->b->npieces)
            pthread_cond_signal(&job->done_cv);
        else if (job->next < job->b->npieces)
            pthread_cond_signal(&pool->work_cv); /* a slot under max_active opened */
    }
    pthread_mutex_unlock(&pool->mu);
    return NULL;
}

fx_pool *fx_pool_create(int nthreads)
{
    fx_pool *pool = calloc(1, sizeof(*pool));
    int i;

    if (!pool)
        return NULL;
    pool->threads = calloc((size_t)nthreads, sizeof(pthread_t));
    if (!pool->threads) {
        free(pool);
        return NULL;
    }
    pool->gen = fx_fork_gen;
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->work_cv, NULL);
    for (i = 0; i < nthreads; i++) {
        if (pthread_create(&pool->threads[i], NULL, worker, pool))
            break;
    }
    pool->nthreads = i;
    if (i == 0) {
        fx_pool_destroy(pool);
        return NULL;
    }
    return pool;
}

void fx_pool_destroy(fx_pool *pool)
{
    if (!pool)
        return;
    /* A forked child has none of the threads and maybe a lock held by one:
     * leave the copy alone. */
    if (FX_FORKED(pool->gen))
        return;
    pthread_mutex_lock(&pool->mu);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->work_cv);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->nthreads; i++)
        pthread_join(pool->threads[i], NULL);
    pthread_cond_destroy(&pool->work_cv);
    pthread_mutex_destroy(&pool->mu);
    free(pool->threads);
    free(pool);
}

int fx_pool_nthreads(const fx_pool *pool) { return pool->nthreads; }

static void start_job(fx_pool *pool, fx_job *job);
static void wait_job(fx_pool *pool, fx_job *job);
static void run_job(fx_pool *pool, fx_job *job);

/* Runs a prepared batch to completion; the caller must not hold the GIL. */
int fx_pool_run(fx_pool *pool, fx_batch *b, int queue_depth)
{
    fx_job job = {.b = b, .max_active = queue_depth > 0 ? queue_depth : 1};

    if (b->npieces == 0)
        return 0;
    if (FX_FORKED(pool->gen)) {
        fx_batch_fail_all(b, EOWNERDEAD); /* no workers here: it would wait forever */
        return -EOWNERDEAD;
    }
    run_job(pool, &job);
    return 0;
}

struct fx_tasks {
    fx_job job;
};

/* Queues a job without waiting for it. */
static void start_job(fx_pool *pool, fx_job *job)
{
    size_t wake;

    pthread_cond_init(&job->done_cv, NULL);
    pthread_mutex_lock(&pool->mu);
    if (pool->tail)
        pool->tail->link = job;
    else
        pool->head = job;
    pool->tail = job;
    /* Wakes as many workers as can start on it, not all of them: a small
     * job (a wave of opens, a few pieces) on a wide pool otherwise wakes
     * every thread to find nothing to do. */
    wake = job_count(job);
    if (wake > (size_t)job->max_active)
        wake = (size_t)job->max_active;
    if (wake > (size_t)pool->nthreads)
        wake = (size_t)pool->nthreads;
    while (wake--)
        pthread_cond_signal(&pool->work_cv);
    pthread_mutex_unlock(&pool->mu);
}

static void wait_job(fx_pool *pool, fx_job *job)
{
    pthread_mutex_lock(&pool->mu);
    while (job->finished < job_count(job))
        pthread_cond_wait(&job->done_cv, &pool->mu);
    pthread_mutex_unlock(&pool->mu);
    pthread_cond_destroy(&job->done_cv);
}

fx_tasks *fx_pool_spawn(fx_pool *pool, size_t n, fx_task_fn fn, void *ctx, int width)
{
    fx_tasks *t;

    if (n == 0 || FX_FORKED(pool->gen) || !(t = calloc(1, sizeof(*t))))
        return NULL;
    t->job.fn = fn;
    t->job.ctx = ctx;
    t->job.ntasks = n;
    t->job.max_active = width > 0 ? width : 1;
    start_job(pool, &t->job);
    return t;
}

void fx_tasks_wait(fx_pool *pool, fx_tasks *t)
{
    if (!t)
        return;
    wait_job(pool, &t->job);
    free(t);
}

int fx_pool_parallel(fx_pool *pool, size_t n, fx_task_fn fn, void *ctx, int width)
{
    fx_job job = {.fn = fn, .ctx = ctx, .ntasks = n, .max_active = width > 0 ? width : 1};

    if (n == 0)
        return 0;
    if (FX_FORKED(pool->gen))
        return -EOWNERDEAD;
    run_job(pool, &job);
    return 0;
}

/* Queues a job and waits until every piece or task of it finished. */
static void run_job(fx_pool *pool, fx_job *job)
{
    start_job(pool, job);
    wait_job(pool, job);
}

/* ---- submit / reap on the pool (fxio.h: fx_tq) ---- */

fx_tq *fx_tq_new(fx_pool *pool, unsigned cap, int width)
{
    fx_tq *q = calloc(1, sizeof(*q));

    if (!q)
        return NULL;
    q->cap = cap ? cap : 1;
    q->work = calloc(q->cap, sizeof(*q->work));
    q->done = calloc(q->cap, sizeof(*q->done));
    if (!q->work || !q->done) {
        free(q->work);
        free(q->done);
        free(q);
        return NULL;
    }
    q->pool = pool;
    q->job.tq = q;
    q->job.max_active = width > 0 ? width : 1;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    return q;
}

int fx_tq_free(fx_tq *q)
{
    if (!q)
        return 0;
    if (q->outstanding)
        return -EBUSY; /* a worker may still write into the caller's memory */
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    free(q->work);
    free(q->done);
    free(q);
    return 0;
}

unsigned fx_tq_outstanding(const fx_tq *q) { return q->outstanding; }

int fx_tq_queue(fx_tq *q, const fx_io *io, fx_tq_after after, void *actx)
{
    fx_pool *pool = q->pool;

    if (FX_FORKED(pool->gen))
        return -EOWNERDEAD; /* no workers here */
    if (io->iov || q->outstanding >= q->cap)
        return io->iov ? -EINVAL : -EBUSY;
    pthread_mutex_lock(&q->mu);
    q->outstanding++;
    pthread_mutex_unlock(&q->mu);
    pthread_mutex_lock(&pool->mu);
    q->work[(q->wh + q->wn) % q->cap] = (tq_item){.io = *io, .after = after, .actx = actx};
    q->wn++;
    if (!q->linked) {
        q->job.link = NULL;
        if (pool->tail)
            pool->tail->link = &q->job;
        else
            pool->head = &q->job;
        pool->tail = &q->job;
        q->linked = 1;
    }
    pthread_cond_signal(&pool->work_cv);
    pthread_mutex_unlock(&pool->mu);
    return 0;
}

int fx_tq_getevents(fx_tq *q, fx_event *ev, unsigned max, long timeout_us)
{
    unsigned n = 0;

    pthread_mutex_lock(&q->mu);
    if (!q->dn && q->outstanding && timeout_us != 0) {
        if (timeout_us < 0) {
            while (!q->dn)
                pthread_cond_wait(&q->cv, &q->mu);
        } else {
            struct timespec ts;

            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += timeout_us / 1000000;
            ts.tv_nsec += (timeout_us % 1000000) * 1000;
            ts.tv_sec += ts.tv_nsec / 1000000000;
            ts.tv_nsec %= 1000000000;
            pthread_cond_timedwait(&q->cv, &q->mu, &ts);
        }
    }
    while (q->dn && n < max) {
        ev[n++] = q->done[q->dh];
        q->dh = (q->dh + 1) % q->cap;
        q->dn--;
    }
    q->outstanding -= n;
    pthread_mutex_unlock(&q->mu);
    return (int)n;
}
