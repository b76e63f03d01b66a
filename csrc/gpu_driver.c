/* GPU driver binding: see gpu_driver.h. */
#define _GNU_SOURCE
#include "gpu_driver.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------- the driver */




gpu_driver fx_gpu_driver;
static cuda_syms cu;
static hip_syms hip;
static pthread_mutex_t drv_mu = PTHREAD_MUTEX_INITIALIZER;

void fx_gpu_driver_atfork_child(void) { pthread_mutex_init(&drv_mu, NULL); }

/* CUDA driver API */
static int cu_init(void) { return cu.Init(0); }
static int cu_device_count(int *n) { return cu.DeviceGetCount(n); }
static int cu_device_get(int ordinal, int *handle) { return cu.DeviceGet(handle, ordinal); }
static int cu_ctx_retain(int handle, void **ctx) { return cu.DevicePrimaryCtxRetain(ctx, handle); }
static void cu_ctx_release(int handle) { cu.DevicePrimaryCtxRelease(handle); }
static int cu_ctx_enter(void *ctx, int ordinal, saved_ctx *s)
{
    int r;

    (void)ordinal;
    s->ctx = NULL;
    /* Unknown, the caller's context could not be put back on leaving. */
    if ((r = cu.CtxGetCurrent(&s->ctx)) != 0)
        return r;
    return cu.CtxSetCurrent(ctx);
}
static void cu_ctx_leave(const saved_ctx *s) { cu.CtxSetCurrent(s->ctx); }
static int cu_host_register(void *p, size_t n) { return cu.MemHostRegister(p, n, 1 /* PORTABLE */); }
static int cu_host_unregister(void *p) { return cu.MemHostUnregister(p); }
static int cu_copy(unsigned long long dst, const void *src, size_t n, void *st)
{
    return cu.MemcpyHtoDAsync(dst, src, n, st);
}
static int cu_stream_create(void **s) { return cu.StreamCreate(s, 1 /* NON_BLOCKING */); }
static int cu_stream_destroy(void *s) { return cu.StreamDestroy(s); }
static int cu_stream_sync(void *s) { return cu.StreamSynchronize(s); }
static int cu_stream_wait(void *s, void *ev) { return cu.StreamWaitEvent(s, ev, 0); }
static int cu_event_create(void **e) { return cu.EventCreate(e, 2 /* DISABLE_TIMING */); }
static int cu_event_record(void *e, void *s) { return cu.EventRecord(e, s); }
static int cu_event_query(void *e) { return cu.EventQuery(e); }
static int cu_event_sync(void *e) { return cu.EventSynchronize(e); }
static int cu_event_destroy(void *e) { return cu.EventDestroy(e); }
static const char *cu_error_name(int code)
{
    const char *s = NULL;
    if (cu.GetErrorName)
        cu.GetErrorName(code, &s);
    return s;
}
static int cu_pci_bus_id(char *buf, int len, int handle, int ordinal)
{
    (void)ordinal;
    return cu.DeviceGetPCIBusId ? cu.DeviceGetPCIBusId(buf, len, handle) : -1;
}

static const gpu_ops cuda_ops = {
    "cuda", "cuMemcpyHtoDAsync", "cuEventRecord/cuStreamWaitEvent", cu_init, cu_device_count, cu_device_get,
    cu_ctx_retain, cu_ctx_release, cu_ctx_enter, cu_ctx_leave, cu_host_register, cu_host_unregister, cu_copy,
    cu_stream_create, cu_stream_destroy, cu_stream_sync, cu_stream_wait, cu_event_create, cu_event_record,
    cu_event_query, cu_event_sync, cu_event_destroy, cu_error_name, cu_pci_bus_id,
};

/* HIP runtime: devices are ordinals, the current device stands for the context */
static int hip_init(void) { return hip.Init(0); }
static int hip_device_count(int *n) { return hip.GetDeviceCount(n); }
static int hip_device_get(int ordinal, int *handle)
{
    *handle = ordinal;
    return 0;
}
static int hip_ctx_retain(int handle, void **ctx)
{
    (void)handle;
    *ctx = NULL;
    return 0;
}
static void hip_ctx_release(int handle) { (void)handle; }
static int hip_ctx_enter(void *ctx, int ordinal, saved_ctx *s)
{
    int r;

    (void)ctx;
    s->dev = -1;
    if ((r = hip.GetDevice(&s->dev)) != 0) /* as for CUDA: the caller's device must be put back */
        return r;
    return hip.SetDevice(ordinal);
}
static void hip_ctx_leave(const saved_ctx *s)
{
    if (s->dev >= 0)
        hip.SetDevice(s->dev);
}
static int hip_host_register(void *p, size_t n) { return hip.HostRegister(p, n, 1 /* hipHostRegisterPortable */); }
static int hip_host_unregister(void *p) { return hip.HostUnregister(p); }
static int hip_copy(unsigned long long dst, const void *src, size_t n, void *st)
{
    return hip.MemcpyHtoDAsync((void *)(uintptr_t)dst, (void *)(uintptr_t)src, n, st);
}
static int hip_stream_create(void **s) { return hip.StreamCreateWithFlags(s, 1 /* hipStreamNonBlocking */); }
static int hip_stream_destroy(void *s) { return hip.StreamDestroy(s); }
static int hip_stream_sync(void *s) { return hip.StreamSynchronize(s); }
static int hip_stream_wait(void *s, void *ev) { return hip.StreamWaitEvent(s, ev, 0); }
static int hip_event_create(void **e) { return hip.EventCreateWithFlags(e, 2 /* hipEventDisableTiming */); }
static int hip_event_record(void *e, void *s) { return hip.EventRecord(e, s); }
static int hip_event_query(void *e) { return hip.EventQuery(e); }
static int hip_event_sync(void *e) { return hip.EventSynchronize(e); }
static int hip_event_destroy(void *e) { return hip.EventDestroy(e); }
static const char *hip_error_name(int code) { return hip.GetErrorName ? hip.GetErrorName(code) : NULL; }
static int hip_pci_bus_id(char *buf, int len, int handle, int ordinal)
{
    (void)handle;
    return hip.DeviceGetPCIBusId ? hip.DeviceGetPCIBusId(buf, len, ordinal) : -1;
}

static const gpu_ops hip_ops = {
    "hip", "hipMemcpyHtoDAsync", "hipEventRecord/hipStreamWaitEvent", hip_init, hip_device_count,
    hip_device_get, hip_ctx_retain, hip_ctx_release, hip_ctx_enter, hip_ctx_leave, hip_host_register,
    hip_host_unregister, hip_copy, hip_stream_create, hip_stream_destroy, hip_stream_sync, hip_stream_wait,
    hip_event_create, hip_event_record, hip_event_query, hip_event_sync, hip_event_destroy, hip_error_name,
    hip_pci_bus_id,
};

static void *sym2(void *lib, const char *a, const char *b)
{
    void *p = dlsym(lib, a);
    return p || !b ? p : dlsym(lib, b);
}

#define LOAD(tab, field, a, b)                                                                 \
    do {                                                                                       \
        *(void **)&tab.field = sym2(lib, a, b);                                                \
        if (!tab.field) {                                                                      \
            snprintf(fx_gpu_driver.err, sizeof(fx_gpu_driver.err), "%s: symbol %s missing", path, a);              \
            return NULL;                                                                       \
        }                                                                                      \
    } while (0)

static const gpu_ops *load_cuda(void *lib, const char *path)
{
    LOAD(cu, Init, "cuInit", NULL);
    LOAD(cu, DeviceGetCount, "cuDeviceGetCount", NULL);
    LOAD(cu, DeviceGet, "cuDeviceGet", NULL);
    LOAD(cu, DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", NULL);
    LOAD(cu, DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease");
    LOAD(cu, CtxSetCurrent, "cuCtxSetCurrent", NULL);
    LOAD(cu, CtxGetCurrent, "cuCtxGetCurrent", NULL);
    LOAD(cu, MemHostRegister, "cuMemHostRegister_v2", "cuMemHostRegister");
    LOAD(cu, MemHostUnregister, "cuMemHostUnregister", NULL);
    LOAD(cu, MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync");
    LOAD(cu, StreamCreate, "cuStreamCreate", NULL);
    LOAD(cu, StreamDestroy, "cuStreamDestroy_v2", "cuStreamDestroy");
    LOAD(cu, StreamSynchronize, "cuStreamSynchronize", NULL);
    LOAD(cu, EventCreate, "cuEventCreate", NULL);
    LOAD(cu, EventRecord, "cuEventRecord", NULL);
    LOAD(cu, EventQuery, "cuEventQuery", NULL);
    LOAD(cu, EventSynchronize, "cuEventSynchronize", NULL);
    LOAD(cu, EventDestroy, "cuEventDestroy_v2", "cuEventDestroy");
    LOAD(cu, StreamWaitEvent, "cuStreamWaitEvent", NULL);
    *(void **)&cu.GetErrorName = dlsym(lib, "cuGetErrorName");
    *(void **)&cu.DeviceGetPCIBusId = dlsym(lib, "cuDeviceGetPCIBusId");
    return &cuda_ops;
}

static const gpu_ops *load_hip(void *lib, const char *path)
{
    LOAD(hip, Init, "hipInit", NULL);
    LOAD(hip, GetDeviceCount, "hipGetDeviceCount", NULL);
    LOAD(hip, SetDevice, "hipSetDevice", NULL);
    LOAD(hip, GetDevice, "hipGetDevice", NULL);
    LOAD(hip, HostRegister, "hipHostRegister", NULL);
    LOAD(hip, HostUnregister, "hipHostUnregister", NULL);
    LOAD(hip, MemcpyHtoDAsync, "hipMemcpyHtoDAsync", NULL);
    LOAD(hip, StreamCreateWithFlags, "hipStreamCreateWithFlags", NULL);
    LOAD(hip, StreamDestroy, "hipStreamDestroy", NULL);
    LOAD(hip, StreamSynchronize, "hipStreamSynchronize", NULL);
    LOAD(hip, EventCreateWithFlags, "hipEventCreateWithFlags", NULL);
    LOAD(hip, EventRecord, "hipEventRecord", NULL);
    LOAD(hip, EventQuery, "hipEventQuery", NULL);
    LOAD(hip, EventSynchronize, "hipEventSynchronize", NULL);
    LOAD(hip, EventDestroy, "hipEventDestroy", NULL);
    LOAD(hip, StreamWaitEvent, "hipStreamWaitEvent", NULL);
    *(void **)&hip.GetErrorName = dlsym(lib, "hipGetErrorName");
    *(void **)&hip.DeviceGetPCIBusId = dlsym(lib, "hipDeviceGetPCIBusId");
    return &hip_ops;
}

const char *fx_gpu_errname(int code)
{
    const char *s = fx_gpu_driver.ops ? fx_gpu_driver.ops->error_name(code) : NULL;
    return s ? s : "unknown error";
}

enum { API_ANY = 0, API_CUDA = 1, API_HIP = 2 };

/* Tries one library; noload: only if it is already loaded in the process
 * (RTLD_NOLOAD: the runtime torch already uses, never a second copy). */
static int try_lib(const char *path, int want, int noload)
{
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL | (noload ? RTLD_NOLOAD : 0));
    const gpu_ops *ops;
    int r = -1, n = 0;

    if (!lib) {
        if (noload)
            return -1; /* not loaded: fx_gpu_driver.err untouched */
        const char *e = dlerror();
        snprintf(fx_gpu_driver.err, sizeof(fx_gpu_driver.err), "%s", e ? e : path);
        return -1;
    }
    memset(&cu, 0, sizeof(cu));
    memset(&hip, 0, sizeof(hip));
    if (want == API_ANY && !dlsym(lib, "cuInit") && !dlsym(lib, "hipInit")) {
        /* else reported as "symbol hipInit missing", as if it were a broken HIP runtime */
        snprintf(fx_gpu_driver.err, sizeof(fx_gpu_driver.err),
                 "%s exports neither cuInit nor hipInit: not a CUDA driver or HIP runtime library", path);
        ops = NULL;
    } else {
        ops = want == API_CUDA || (want == API_ANY && dlsym(lib, "cuInit")) ? load_cuda(lib, path) : load_hip(lib, path);
    }
    if (ops) {
        fx_gpu_driver.ops = ops; /* for drv_errname */
        r = ops->init();
        if (r == 0)
            r = ops->device_count(&n);
        if (r != 0) {
            snprintf(fx_gpu_driver.err, sizeof(fx_gpu_driver.err), "%s: init failed: %s (%d)", path, fx_gpu_errname(r), r);
            r = -1;
        } else if (n < 1) {
            snprintf(fx_gpu_driver.err, sizeof(fx_gpu_driver.err), "%s: no GPU devices", path);
            r = -1;
        }
        if (r != 0 && !fx_gpu_driver.found[0]) {
            snprintf(fx_gpu_driver.found, sizeof(fx_gpu_driver.found), "%s", path);
            fx_gpu_driver.found_api = ops->api;
        }
    }
    if (r != 0) {
        fx_gpu_driver.ops = NULL;
        dlclose(lib);
        memset(&cu, 0, sizeof(cu));
        memset(&hip, 0, sizeof(hip));
        return -1;
    }
    fx_gpu_driver.lib = lib;
    fx_gpu_driver.ndev = n;
    snprintf(fx_gpu_driver.path, sizeof(fx_gpu_driver.path), "%s", path);
    return 0;
}

static const struct {
    const char *name;
    int api;
} driver_names[] = {
    {"libcuda.so.1", API_CUDA},
    {"libamdhip64.so.7", API_HIP},
    {"libamdhip64.so.6", API_HIP},
    {"libamdhip64.so.5", API_HIP}, /* ROCm 5.x runtime-only hosts: the bare name comes with -dev */
    {"libamdhip64.so", API_HIP},
};
#define N_DRIVER_NAMES ((int)(sizeof(driver_names) / sizeof(driver_names[0])))

/* Binds the driver once per process; 0 or -1 (fx_gpu_driver.err says why). */
int fx_gpu_driver_load(void)
{
    int r;

    pthread_mutex_lock(&drv_mu);
    if (!fx_gpu_driver.ops) { /* a failure is not cached: tried again next time */
        const char *env = getenv("LMCACHE_FX_GPU_DRIVER");
        char errs[1024] = "";

        if (env && *env) {
            try_lib(env, API_ANY, 0);
        } else {
            /* First a driver the process already loaded (torch's), then a fresh
             * load; versioned HIP names before the unversioned one, so a host
             * never ends up with two HIP runtimes. */
            int i, ok = 0;
            for (i = 0; i < N_DRIVER_NAMES && !ok; i++)
                ok = try_lib(driver_names[i].name, driver_names[i].api, 1) == 0;
            if (!ok && try_lib("libcuda.so.1", API_CUDA, 0) != 0) {
                snprintf(errs, sizeof(errs), "%s", fx_gpu_driver.err);
                for (i = 1; i < N_DRIVER_NAMES && !ok; i++)
                    ok = try_lib(driver_names[i].name, API_HIP, 0) == 0;
                if (!ok) {
                    char tmp[512];
                    memcpy(tmp, fx_gpu_driver.err, sizeof(tmp));
                    snprintf(fx_gpu_driver.err, sizeof(fx_gpu_driver.err), "no GPU driver: CUDA: %.200s; ROCm: %.200s", errs, tmp);
                }
            }
        }
    }
    r = fx_gpu_driver.ops ? 0 : -1;
    pthread_mutex_unlock(&drv_mu);
    return r;
}
