/* The GPU driver behind the staging pipeline (gpu.c): CUDA's driver API or
 * the HIP runtime, found at run time with dlopen (the one torch loaded first),
 * bound once into one table of operations that every call goes through.
 * No Python here. */
#ifndef FX_GPU_DRIVER_H
#define FX_GPU_DRIVER_H

#include <stddef.h>

#define NOT_READY 600 /* CUDA_ERROR_NOT_READY == hipErrorNotReady */

/* The raw entry points of the library found (CUDA driver API or HIP runtime). */
typedef struct {
    int (*Init)(unsigned);
    int (*DeviceGetCount)(int *);
    int (*DeviceGet)(int *, int);
    int (*DevicePrimaryCtxRetain)(void **, int);
    int (*DevicePrimaryCtxRelease)(int);
    int (*CtxSetCurrent)(void *);
    int (*CtxGetCurrent)(void **);
    int (*MemHostRegister)(void *, size_t, unsigned);
    int (*MemHostUnregister)(void *);
    int (*MemcpyHtoDAsync)(unsigned long long, const void *, size_t, void *);
    int (*StreamCreate)(void **, unsigned);
    int (*StreamDestroy)(void *);
    int (*StreamSynchronize)(void *);
    int (*EventCreate)(void **, unsigned);
    int (*EventRecord)(void *, void *);
    int (*EventQuery)(void *);
    int (*EventSynchronize)(void *);
    int (*EventDestroy)(void *);
    int (*StreamWaitEvent)(void *, void *, unsigned);
    int (*GetErrorName)(int, const char **);  /* optional */
    int (*DeviceGetPCIBusId)(char *, int, int); /* optional */
} cuda_syms;

typedef struct {
    int (*Init)(unsigned);
    int (*GetDeviceCount)(int *);
    int (*SetDevice)(int);
    int (*GetDevice)(int *);
    int (*HostRegister)(void *, size_t, unsigned);
    int (*HostUnregister)(void *);
    int (*MemcpyHtoDAsync)(void *, void *, size_t, void *);
    int (*StreamCreateWithFlags)(void **, unsigned);
    int (*StreamDestroy)(void *);
    int (*StreamSynchronize)(void *);
    int (*EventCreateWithFlags)(void **, unsigned);
    int (*EventRecord)(void *, void *);
    int (*EventQuery)(void *);
    int (*EventSynchronize)(void *);
    int (*EventDestroy)(void *);
    int (*StreamWaitEvent)(void *, void *, unsigned);
    const char *(*GetErrorName)(int);           /* optional */
    int (*DeviceGetPCIBusId)(char *, int, int); /* optional */
} hip_syms;

/* The current device of a thread, saved by ctx_enter and put back by ctx_leave. */
typedef struct {
    void *ctx;
    int dev;
} saved_ctx;

/* What the pipeline needs of a GPU driver: one table per API, chosen once when
 * the library is bound; every call goes through it. Returns are the driver's
 * status codes (0 = success). */
typedef struct {
    const char *api;        /* "cuda" | "hip" */
    const char *copy_name;  /* for messages */
    const char *order_name;
    int (*init)(void);
    int (*device_count)(int *n);
    /* ordinal -> the handle contexts and bus ids take (CUDA: CUdevice) */
    int (*device_get)(int ordinal, int *handle);
    /* CUDA: retain / release the primary context; HIP: nothing to do */
    int (*ctx_retain)(int handle, void **ctx);
    void (*ctx_release)(int handle);
    /* makes the pool's device current on this thread */
    int (*ctx_enter)(void *ctx, int ordinal, saved_ctx *s);
    void (*ctx_leave)(const saved_ctx *s);
    int (*host_register)(void *p, size_t n); /* page-lock, portable */
    int (*host_unregister)(void *p);
    int (*copy_htod)(unsigned long long dst, const void *src, size_t n, void *stream);
    int (*stream_create)(void **s); /* non-blocking */
    int (*stream_destroy)(void *s);
    int (*stream_sync)(void *s);
    int (*stream_wait)(void *s, void *ev);
    int (*event_create)(void **e); /* timing disabled */
    int (*event_record)(void *e, void *s);
    int (*event_query)(void *e); /* 0 done, NOT_READY, or an error */
    int (*event_sync)(void *e);
    int (*event_destroy)(void *e);
    const char *(*error_name)(int code); /* NULL when unknown */
    int (*pci_bus_id)(char *buf, int len, int handle, int ordinal); /* -1: not offered */
} gpu_ops;

typedef struct {
    const gpu_ops *ops; /* NULL until a driver is bound */
    void *lib;
    char path[512];
    char err[512];
    int ndev;
    /* Not bound, but a driver library was there whose init or device count
     * failed (no device visible in this container, a driver/module
     * mismatch): its path and API, so that is not called "no driver". */
    char found[512];
    const char *found_api;
} gpu_driver;

extern gpu_driver fx_gpu_driver;

/* Binds the driver once (LMCACHE_FX_GPU_DRIVER names a library to use instead);
 * 0 when bound, else -1 with fx_gpu_driver.err saying why. */
int fx_gpu_driver_load(void);
/* The driver's name for a status code ("CUDA_ERROR_INVALID_VALUE"), never NULL. */
const char *fx_gpu_errname(int code);
/* pthread_atfork child handler: the binding lock is usable again in a child. */
void fx_gpu_driver_atfork_child(void);

#endif
