/* A stand-in for the CUDA driver API, for tests on machines without a GPU.
 *
 * It exports the driver functions lmcache-fx's GPU pipeline looks up (selected
 * with LMCACHE_FX_GPU_DRIVER=/path/to/this.so). "Device memory" is host memory:
 * a device pointer is an ordinary address. Each stream has a worker thread that
 * runs its queue in order: a copy logs its start, sleeps the configured delay,
 * memcpys and logs its end; an event record marks the event complete when the
 * worker reaches it. So copies complete asynchronously, like a GPU's.
 *
 * Test controls (call through ctypes on the same path; dlopen shares it):
 *   fake_gpu_reset(), fake_gpu_set_delay_us(us), fake_gpu_fail_copy(nth, mode)
 *   (mode 0: the nth cuMemcpyHtoDAsync returns CUDA_ERROR_INVALID_VALUE;
 *    mode 1: it is accepted, then fails on the stream, and like a real
 *    context the error sticks: CUDA_ERROR_ILLEGAL_ADDRESS from then on),
 *   fake_gpu_log_len(), fake_gpu_log_get(i, out[6]) -> kind, t_ns, seq, dst,
 *   src, n (kind 1 copy start, 2 copy end, 3 event done), fake_gpu_pinned_bytes(),
 *   fake_gpu_unpinned_copies().
 * Build: gcc -O2 -shared -fPIC -pthread -o fake_gpu_driver.so fake_gpu_driver.c
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))
enum { OK = 0, E_INVALID_VALUE = 1, E_INVALID_DEVICE = 101, E_INVALID_CONTEXT = 201,
       E_NOT_READY = 600, E_ILLEGAL_ADDRESS = 700, E_ALREADY_REGISTERED = 712, E_NOT_REGISTERED = 713 };

typedef struct event {
    unsigned long recorded, done;
} event_t;

typedef struct item {
    int kind; /* 1 copy, 2 event */
    char *dst;
    const char *src;
    size_t n;
    long seq;
    int fail;
    event_t *ev;
    unsigned long gen;
    struct item *next;
} item_t;

typedef struct stream {
    pthread_t th;
    item_t *head, *tail;
    int busy, stop;
    pthread_cond_t cv;
} stream_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static unsigned delay_us = 0;
static long ncopies = 0, fail_at = 0;
static int fail_mode = 0;
static int sticky = 0;
static int ctxs[4];
static __thread void *current;

#define MAXREG 64
static struct { char *p; size_t n; } regs[MAXREG];
static long pinned_bytes, unpinned_copies;

#define LOGMAX (1 << 18)
static long long logbuf[LOGMAX][6];
static long loglen;

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static void logit(int kind, long seq, const void *dst, const void *src, size_t n)
{
    /* mu held */
    if (loglen < LOGMAX) {
        long long *e = logbuf[loglen++];
        e[0] = kind;
        e[1] = now_ns();
        e[2] = seq;
        e[3] = (long long)(uintptr_t)dst;
        e[4] = (long long)(uintptr_t)src;
        e[5] = (long long)n;
    }
}

static int is_pinned(const char *p, size_t n)
{
    for (int i = 0; i < MAXREG; i++)
        if (regs[i].p && p >= regs[i].p && p + n <= regs[i].p + regs[i].n)
            return 1;
    return 0;
}

static void *worker(void *arg)
{
    stream_t *s = arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        item_t *it;
        while (!s->stop && !s->head)
            pthread_cond_wait(&s->cv, &mu);
        if (!s->head && s->stop)
            break;
        it = s->head;
        s->head = it->next;
        if (!s->head)
            s->tail = NULL;
        s->busy = 1;
        if (it->kind == 1) {
            logit(1, it->seq, it->dst, it->src, it->n);
            pthread_mutex_unlock(&mu);
            if (delay_us)
                usleep(delay_us);
            if (!it->fail && !sticky)
                memcpy(it->dst, it->src, it->n);
            pthread_mutex_lock(&mu);
            if (it->fail)
                sticky = E_ILLEGAL_ADDRESS;
            logit(2, it->seq, it->dst, it->src, it->n);
        } else {
            it->ev->done = it->gen;
            logit(3, (long)it->gen, it->ev, NULL, 0);
        }
        s->busy = 0;
        free(it);
        pthread_cond_broadcast(&done_cv);
    }
    pthread_mutex_unlock(&mu);
    return NULL;
}

static void enqueue(stream_t *s, item_t *it)
{
    it->next = NULL;
    if (s->tail)
        s->tail->next = it;
    else
        s->head = it;
    s->tail = it;
    pthread_cond_signal(&s->cv);
}

/* ---- driver API ---- */
API int cuInit(unsigned flags) { (void)flags; return OK; }
API int cuDeviceGetCount(int *n) { *n = 1; return OK; }
API int cuDeviceGet(int *d, int ord) { if (ord != 0) return E_INVALID_DEVICE; *d = ord; return OK; }
API int cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = &ctxs[dev & 3]; return OK; }
API int cuDevicePrimaryCtxRelease_v2(int dev) { (void)dev; return OK; }
API int cuCtxSetCurrent(void *ctx) { current = ctx; return OK; }
API int cuCtxGetCurrent(void **ctx) { *ctx = current; return OK; }

API int cuGetErrorName(int code, const char **s)
{
    switch (code) {
    case OK: *s = "CUDA_SUCCESS"; break;
    case E_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case E_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case E_NOT_READY: *s = "CUDA_ERROR_NOT_READY"; break;
    case E_ILLEGAL_ADDRESS: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
    default: *s = "CUDA_ERROR_UNKNOWN"; return E_INVALID_VALUE;
    }
    return OK;
}

API int cuMemHostRegister_v2(void *p, size_t n, unsigned flags)
{
    int r = E_INVALID_VALUE;
    (void)flags;
    pthread_mutex_lock(&mu);
    if (is_pinned(p, 1)) {
        r = E_ALREADY_REGISTERED;
    } else {
        for (int i = 0; i < MAXREG; i++)
            if (!regs[i].p) {
                regs[i].p = p;
                regs[i].n = n;
                pinned_bytes += (long)n;
                r = OK;
                break;
            }
    }
    pthread_mutex_unlock(&mu);
    return r;
}

API int cuMemHostUnregister(void *p)
{
    int r = E_NOT_REGISTERED;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAXREG; i++)
        if (regs[i].p == p) {
            pinned_bytes -= (long)regs[i].n;
            regs[i].p = NULL;
            r = OK;
        }
    pthread_mutex_unlock(&mu);
    return r;
}

API int cuStreamCreate(void **out, unsigned flags)
{
    stream_t *s = calloc(1, sizeof(*s));
    (void)flags;
    if (!current)
        return E_INVALID_CONTEXT;
    pthread_cond_init(&s->cv, NULL);
    pthread_create(&s->th, NULL, worker, s);
    *out = s;
    return OK;
}

API int cuStreamSynchronize(void *st)
{
    stream_t *s = st;
    int r;
    pthread_mutex_lock(&mu);
    while (s->head || s->busy)
        pthread_cond_wait(&done_cv, &mu);
    r = sticky;
    pthread_mutex_unlock(&mu);
    return r;
}

API int cuStreamDestroy_v2(void *st)
{
    stream_t *s = st;
    pthread_mutex_lock(&mu);
    s->stop = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&mu);
    pthread_join(s->th, NULL);
    pthread_cond_destroy(&s->cv);
    free(s);
    return OK;
}

API int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, void *st)
{
    item_t *it;
    int r = OK;
    if (!current)
        return E_INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    ncopies++;
    if (sticky) {
        r = sticky;
    } else if (fail_at && ncopies == fail_at && fail_mode == 0) {
        r = E_INVALID_VALUE;
    } else {
        it = calloc(1, sizeof(*it));
        it->kind = 1;
        it->dst = (char *)(uintptr_t)dst;
        it->src = src;
        it->n = n;
        it->seq = ncopies;
        it->fail = fail_at && ncopies == fail_at && fail_mode == 1;
        if (!is_pinned(src, n))
            unpinned_copies++;
        enqueue(st, it);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

API int cuEventCreate(void **out, unsigned flags)
{
    (void)flags;
    *out = calloc(1, sizeof(event_t));
    return OK;
}

API int cuEventDestroy_v2(void *ev) { free(ev); return OK; }

API int cuEventRecord(void *ev, void *st)
{
    event_t *e = ev;
    item_t *it = calloc(1, sizeof(*it));
    pthread_mutex_lock(&mu);
    it->kind = 2;
    it->ev = e;
    it->gen = ++e->recorded;
    enqueue(st, it);
    pthread_mutex_unlock(&mu);
    return OK;
}

API int cuEventQuery(void *ev)
{
    event_t *e = ev;
    int r;
    pthread_mutex_lock(&mu);
    r = sticky ? sticky : e->done >= e->recorded ? OK : E_NOT_READY;
    pthread_mutex_unlock(&mu);
    return r;
}

API int cuEventSynchronize(void *ev)
{
    event_t *e = ev;
    int r;
    pthread_mutex_lock(&mu);
    while (!sticky && e->done < e->recorded)
        pthread_cond_wait(&done_cv, &mu);
    r = sticky;
    pthread_mutex_unlock(&mu);
    return r;
}

/* ---- test controls ---- */
API void fake_gpu_reset(void)
{
    pthread_mutex_lock(&mu);
    loglen = 0;
    ncopies = 0;
    fail_at = 0;
    fail_mode = 0;
    sticky = 0;
    delay_us = 0;
    unpinned_copies = 0;
    pthread_mutex_unlock(&mu);
}
API void fake_gpu_set_delay_us(unsigned us) { delay_us = us; }
API void fake_gpu_fail_copy(long nth, int mode)
{
    pthread_mutex_lock(&mu);
    fail_at = nth;
    fail_mode = mode;
    pthread_mutex_unlock(&mu);
}
API long fake_gpu_log_len(void) { return loglen; }
API int fake_gpu_log_get(long i, long long *out)
{
    if (i < 0 || i >= loglen)
        return -1;
    memcpy(out, logbuf[i], sizeof(logbuf[i]));
    return 0;
}
API long fake_gpu_pinned_bytes(void) { return pinned_bytes; }
API long fake_gpu_unpinned_copies(void) { return unpinned_copies; }
