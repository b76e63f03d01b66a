/* A stand-in for the CUDA driver API (or, built with -DFAKE_HIP, the HIP
 * runtime API), for tests on machines without a GPU.
 *
 * It exports the driver functions lmcache-fx's GPU pipeline looks up (selected
 * with LMCACHE_FX_GPU_DRIVER=/path/to/this.so). "Device memory" is host memory:
 * a device pointer is an ordinary address. Each stream has a worker thread that
 * runs its queue in order: a copy logs its start, sleeps the configured delay,
 * memcpys and logs its end; an event record marks the event complete when the
 * worker reaches it; a stream-wait item blocks the stream until the event's
 * recorded work is done (cuStreamWaitEvent). So copies complete asynchronously,
 * like a GPU's, and work on different streams is unordered unless an event
 * orders it: a "kernel" (fake_gpu_kernel) queued on the caller's stream that
 * reads or writes the destination after a delay shows the race. The NULL
 * stream (0) is one more stream with its own worker.
 *
 * Device handles are not ordinals (cuDeviceGet(ord) gives 100 + ord) and the
 * primary context is reference counted (fake_gpu_ctx_refs), so releasing it
 * with the ordinal instead of the handle is seen. Build defines: FAKE_HIP
 * (hip* names instead of cu*), FAKE_NDEV (devices, default 1).
 *
 * Test controls (call through ctypes on the same path; dlopen shares it):
 *   fake_gpu_reset(), fake_gpu_set_delay_us(us), fake_gpu_fail_copy(nth, mode)
 *   (mode 0: the nth cuMemcpyHtoDAsync returns CUDA_ERROR_INVALID_VALUE;
 *    mode 1: it is accepted, then fails on the stream, and like a real
 *    context the error sticks: CUDA_ERROR_ILLEGAL_ADDRESS from then on),
 *   fake_gpu_log_len(), fake_gpu_log_get(i, out[6]) -> kind, t_ns, seq, dst,
 *   src, n (kind 1 copy start, 2 copy end, 3 event done), fake_gpu_pinned_bytes(),
 *   fake_gpu_unpinned_copies(), fake_gpu_fail_register(on) (host register
 *   refused), fake_gpu_fail_call(name, nth, code) (the nth call of the entry
 *   point `name` from now returns `code`; CUDA_ERROR_ILLEGAL_ADDRESS also sticks,
 *   as a GPU fault does: for cuCtxGetCurrent, cuCtxSetCurrent, cuEventRecord,
 *   cuStreamWaitEvent), fake_gpu_set_bus_id(str), fake_gpu_ctx_refs(), fake_gpu_ndev(),
 *   fake_gpu_api() ("cuda" or "hip"), and the caller's-stream model:
 *   fake_gpu_stream_new() -> stream, fake_gpu_stream_sync(stream),
 *   fake_gpu_kernel(stream, dst, src, byte, n, delay_us) (after the delay:
 *   memcpy(dst, src, n), or memset(dst, byte, n) when src is NULL; logged
 *   as kinds 4 start / 5 end).
 * Build: gcc -O2 -shared -fPIC -pthread -o fake_gpu_driver.so fake_gpu_driver.c
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))
enum { OK = 0, E_INVALID_VALUE = 1, E_OUT_OF_MEMORY = 2, E_INVALID_DEVICE = 101, E_INVALID_CONTEXT = 201,
       E_NOT_READY = 600, E_ILLEGAL_ADDRESS = 700, E_ALREADY_REGISTERED = 712, E_NOT_REGISTERED = 713 };
#ifndef FAKE_NDEV
#define FAKE_NDEV 1
#endif
#define DEV_BASE 100 /* cuDeviceGet(ord) -> DEV_BASE + ord: a handle is not an ordinal */

typedef struct event {
    unsigned long recorded, done;
} event_t;

typedef struct item {
    int kind; /* 1 copy, 2 event record, 3 kernel, 4 wait for an event */
    char *dst;
    const char *src;
    size_t n;
    long seq;
    int fail;
    int byte;
    unsigned delay;
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
static long ncopies = 0, fail_at = 0, nkernels = 0;
static int fail_mode = 0;
static int sticky = 0;
static int fail_register = 0;
static char fail_name[64];
static long fail_nth, fail_calls;
static int fail_code;
static char bus_id[64] = "0000:FA:1E.0";
static int ctxs[FAKE_NDEV], ctx_refs[FAKE_NDEV];
static __thread void *current __attribute__((unused));
static stream_t *null_stream;

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
        } else if (it->kind == 3) {
            logit(4, it->seq, it->dst, it->src, it->n);
            pthread_mutex_unlock(&mu);
            if (it->delay)
                usleep(it->delay);
            if (it->src)
                memcpy(it->dst, it->src, it->n);
            else
                memset(it->dst, it->byte, it->n);
            pthread_mutex_lock(&mu);
            logit(5, it->seq, it->dst, it->src, it->n);
        } else if (it->kind == 4) {
            while (!sticky && it->ev->done < it->gen)
                pthread_cond_wait(&done_cv, &mu);
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

/* NULL where its thread cannot start (a pids limit): the real drivers then
 * refuse the stream with out-of-memory, and so does this one. */
static stream_t *stream_new(void)
{
    stream_t *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    pthread_cond_init(&s->cv, NULL);
    if (pthread_create(&s->th, NULL, worker, s)) {
        pthread_cond_destroy(&s->cv);
        free(s);
        return NULL;
    }
    return s;
}

/* mu held; NULL is the default stream; NULL back when it cannot be made */
static stream_t *get_stream(void *st)
{
    if (st)
        return st;
    if (!null_stream)
        null_stream = stream_new();
    return null_stream;
}

static void enqueue(stream_t *s, item_t *it);

/* mu held: queues `it` on stream st, or frees it and says why not. */
static int enqueue_on(void *st, item_t *it)
{
    stream_t *s = get_stream(st);
    if (!s) {
        free(it);
        return E_OUT_OF_MEMORY;
    }
    enqueue(s, it);
    return OK;
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

/* The code fake_gpu_fail_call asked of this call of `name`, else OK. */
__attribute__((unused)) static int injected(const char *name)
{
    int r = OK;
    pthread_mutex_lock(&mu);
    if (fail_nth && !strcmp(name, fail_name) && ++fail_calls == fail_nth) {
        r = fail_code;
        if (r == E_ILLEGAL_ADDRESS)
            sticky = r;
    }
    pthread_mutex_unlock(&mu);
    return r;
}

/* ---- the driver, API-neutral ---- */
__attribute__((unused)) static int f_device_get(int *d, int ord)
{
    if (ord < 0 || ord >= FAKE_NDEV)
        return E_INVALID_DEVICE;
    *d = DEV_BASE + ord;
    return OK;
}

__attribute__((unused)) static int f_ctx_retain(void **ctx, int dev)
{
    if (dev < DEV_BASE || dev >= DEV_BASE + FAKE_NDEV)
        return E_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    ctx_refs[dev - DEV_BASE]++;
    pthread_mutex_unlock(&mu);
    *ctx = &ctxs[dev - DEV_BASE];
    return OK;
}

__attribute__((unused)) static int f_ctx_release(int dev)
{
    int r = OK;
    if (dev < DEV_BASE || dev >= DEV_BASE + FAKE_NDEV)
        return E_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    if (ctx_refs[dev - DEV_BASE] <= 0)
        r = E_INVALID_CONTEXT;
    else
        ctx_refs[dev - DEV_BASE]--;
    pthread_mutex_unlock(&mu);
    return r;
}

static int f_host_register(void *p, size_t n)
{
    int r = E_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (fail_register) {
        r = E_INVALID_VALUE;
    } else if (is_pinned(p, 1)) {
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

static int f_host_unregister(void *p)
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

static int f_stream_sync(void *st)
{
    stream_t *s;
    int r;
    pthread_mutex_lock(&mu);
    s = st ? st : null_stream; /* no default stream yet: nothing queued on it */
    while (s && (s->head || s->busy))
        pthread_cond_wait(&done_cv, &mu);
    r = sticky;
    pthread_mutex_unlock(&mu);
    return r;
}

static int f_stream_destroy(void *st)
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

static int f_copy(unsigned long long dst, const void *src, size_t n, void *st)
{
    item_t *it;
    int r = OK;
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
        r = enqueue_on(st, it);
    }
    pthread_mutex_unlock(&mu);
    return r;
}

static int f_event_create(void **out)
{
    *out = calloc(1, sizeof(event_t));
    return OK;
}

static int f_event_record(void *ev, void *st)
{
    event_t *e = ev;
    item_t *it;
    pthread_mutex_lock(&mu);
    if (sticky) { /* a faulted context refuses new work */
        pthread_mutex_unlock(&mu);
        return sticky;
    }
    it = calloc(1, sizeof(*it));
    it->kind = 2;
    it->ev = e;
    it->gen = e->recorded + 1;
    int r = enqueue_on(st, it);
    if (r == OK)
        e->recorded++;
    pthread_mutex_unlock(&mu);
    return r;
}

static int f_stream_wait_event(void *st, void *ev, unsigned flags)
{
    event_t *e = ev;
    item_t *it;
    (void)flags;
    if (flags)
        return E_INVALID_VALUE;
    it = calloc(1, sizeof(*it));
    pthread_mutex_lock(&mu);
    it->kind = 4;
    it->ev = e;
    it->gen = e->recorded; /* the work recorded so far, as CUDA does */
    int r = enqueue_on(st, it);
    pthread_mutex_unlock(&mu);
    return r;
}

static int f_event_query(void *ev)
{
    event_t *e = ev;
    int r;
    pthread_mutex_lock(&mu);
    r = sticky ? sticky : e->done >= e->recorded ? OK : E_NOT_READY;
    pthread_mutex_unlock(&mu);
    return r;
}

static int f_event_sync(void *ev)
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

static const char *f_errname(int code)
{
    switch (code) {
#ifdef FAKE_HIP
    case OK: return "hipSuccess";
    case E_INVALID_VALUE: return "hipErrorInvalidValue";
    case E_INVALID_CONTEXT: return "hipErrorInvalidContext";
    case E_NOT_READY: return "hipErrorNotReady";
    case E_ILLEGAL_ADDRESS: return "hipErrorIllegalAddress";
#else
    case OK: return "CUDA_SUCCESS";
    case E_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case E_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case E_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case E_ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
#endif
    default: return NULL;
    }
}

static int f_bus_id(char *out, int len, int dev)
{
    if (dev < DEV_BASE || dev >= DEV_BASE + FAKE_NDEV || len < 1)
        return E_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    snprintf(out, (size_t)len, "%s", bus_id);
    pthread_mutex_unlock(&mu);
    return OK;
}

#ifndef FAKE_HIP
/* ---- CUDA driver API ---- */
API int cuInit(unsigned flags) { (void)flags; return OK; }
API int cuDeviceGetCount(int *n) { *n = FAKE_NDEV; return OK; }
API int cuDeviceGet(int *d, int ord) { return f_device_get(d, ord); }
API int cuDevicePrimaryCtxRetain(void **ctx, int dev) { return f_ctx_retain(ctx, dev); }
API int cuDevicePrimaryCtxRelease_v2(int dev) { return f_ctx_release(dev); }
API int cuCtxSetCurrent(void *ctx)
{
    int r = injected("cuCtxSetCurrent");
    if (r == OK)
        current = ctx;
    return r;
}
API int cuCtxGetCurrent(void **ctx)
{
    int r = injected("cuCtxGetCurrent");
    if (r == OK)
        *ctx = current;
    return r;
}
API int cuDeviceGetPCIBusId(char *out, int len, int dev) { return f_bus_id(out, len, dev); }

API int cuGetErrorName(int code, const char **s)
{
    *s = f_errname(code);
    if (!*s) {
        *s = "CUDA_ERROR_UNKNOWN";
        return E_INVALID_VALUE;
    }
    return OK;
}

/* Pinned memory belongs to a context: CUDA refuses both calls without one current. */
API int cuMemHostRegister_v2(void *p, size_t n, unsigned flags)
{
    (void)flags;
    return current ? f_host_register(p, n) : E_INVALID_CONTEXT;
}
API int cuMemHostUnregister(void *p) { return current ? f_host_unregister(p) : E_INVALID_CONTEXT; }

API int cuStreamCreate(void **out, unsigned flags)
{
    (void)flags;
    if (!current)
        return E_INVALID_CONTEXT;
    *out = stream_new();
    return *out ? OK : E_OUT_OF_MEMORY;
}
API int cuStreamSynchronize(void *st) { return f_stream_sync(st); }
API int cuStreamDestroy_v2(void *st) { return f_stream_destroy(st); }
API int cuStreamWaitEvent(void *st, void *ev, unsigned flags)
{
    int r = injected("cuStreamWaitEvent");
    if (r != OK)
        return r;
    if (!current)
        return E_INVALID_CONTEXT;
    return f_stream_wait_event(st, ev, flags);
}

API int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, void *st)
{
    if (!current)
        return E_INVALID_CONTEXT;
    return f_copy(dst, src, n, st);
}

API int cuEventCreate(void **out, unsigned flags) { (void)flags; return f_event_create(out); }
API int cuEventDestroy_v2(void *ev) { free(ev); return OK; }
API int cuEventRecord(void *ev, void *st)
{
    int r = injected("cuEventRecord");
    return r != OK ? r : f_event_record(ev, st);
}
API int cuEventQuery(void *ev) { return f_event_query(ev); }
API int cuEventSynchronize(void *ev) { return f_event_sync(ev); }
#else
/* ---- HIP runtime API: the current device is per thread, device 0 at first ---- */
static __thread int hip_dev;
API int hipInit(unsigned flags) { (void)flags; return OK; }
API int hipGetDeviceCount(int *n) { *n = FAKE_NDEV; return OK; }
API int hipSetDevice(int d)
{
    if (d < 0 || d >= FAKE_NDEV)
        return E_INVALID_DEVICE;
    hip_dev = d;
    return OK;
}
API int hipGetDevice(int *d) { *d = hip_dev; return OK; }
API int hipDeviceGetPCIBusId(char *out, int len, int dev) { return f_bus_id(out, len, DEV_BASE + dev); }
API const char *hipGetErrorName(int code)
{
    const char *s = f_errname(code);
    return s ? s : "hipErrorUnknown";
}
API int hipHostRegister(void *p, size_t n, unsigned flags) { (void)flags; return f_host_register(p, n); }
API int hipHostUnregister(void *p) { return f_host_unregister(p); }
API int hipMemcpyHtoDAsync(void *dst, void *src, size_t n, void *st)
{
    return f_copy((unsigned long long)(uintptr_t)dst, src, n, st);
}
API int hipStreamCreateWithFlags(void **out, unsigned flags)
{
    (void)flags;
    *out = stream_new();
    return *out ? OK : E_OUT_OF_MEMORY;
}
API int hipStreamDestroy(void *st) { return f_stream_destroy(st); }
API int hipStreamSynchronize(void *st) { return f_stream_sync(st); }
API int hipStreamWaitEvent(void *st, void *ev, unsigned flags) { return f_stream_wait_event(st, ev, flags); }
API int hipEventCreateWithFlags(void **out, unsigned flags) { (void)flags; return f_event_create(out); }
API int hipEventRecord(void *ev, void *st) { return f_event_record(ev, st); }
API int hipEventQuery(void *ev) { return f_event_query(ev); }
API int hipEventSynchronize(void *ev) { return f_event_sync(ev); }
API int hipEventDestroy(void *ev) { free(ev); return OK; }
#endif

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
    fail_register = 0;
    fail_nth = fail_calls = 0;
    snprintf(bus_id, sizeof(bus_id), "0000:FA:1E.0");
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
API void fake_gpu_fail_register(int on) { fail_register = on; }
API void fake_gpu_fail_call(const char *name, long nth, int code)
{
    pthread_mutex_lock(&mu);
    snprintf(fail_name, sizeof(fail_name), "%s", name);
    fail_nth = nth;
    fail_calls = 0;
    fail_code = code;
    pthread_mutex_unlock(&mu);
}
API void fake_gpu_set_bus_id(const char *s)
{
    pthread_mutex_lock(&mu);
    snprintf(bus_id, sizeof(bus_id), "%s", s ? s : "");
    pthread_mutex_unlock(&mu);
}
API int fake_gpu_ctx_refs(void)
{
    int n = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < FAKE_NDEV; i++)
        n += ctx_refs[i];
    pthread_mutex_unlock(&mu);
    return n;
}
API int fake_gpu_ndev(void) { return FAKE_NDEV; }
#ifdef FAKE_HIP
API const char *fake_gpu_api(void) { return "hip"; }
#else
API const char *fake_gpu_api(void) { return "cuda"; }
#endif
API void *fake_gpu_stream_new(void) { return stream_new(); }
API int fake_gpu_stream_sync(void *st) { return f_stream_sync(st); }
API void fake_gpu_kernel(void *st, void *dst, const void *src, int byte, size_t n, unsigned delay)
{
    item_t *it = calloc(1, sizeof(*it));
    pthread_mutex_lock(&mu);
    it->kind = 3;
    it->dst = dst;
    it->src = src;
    it->byte = byte;
    it->n = n;
    it->delay = delay;
    it->seq = ++nkernels;
    enqueue_on(st, it); /* a test helper: no stream, no kernel run */
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
