/* The io_uring submit/reap API (csrc/ring.c), in the spirit of fio's
 * queue / commit / getevents: one ring-setup path with one fallback ladder,
 * reads and writes queued as fx_io, committed, and reaped with a timeout and
 * the retry ladder inside. The batch runner (uring_engine.c) and the GPU
 * pipeline (gpu.c) both drive rings through it. Internal: includes liburing. */
#ifndef FX_RING_H
#define FX_RING_H

#include "fxio.h"

#ifdef FX_HAVE_LIBURING
#include <liburing.h>

struct fx_ring {
    struct io_uring ring;
    unsigned entries;
    unsigned queued;   /* prepared, not yet taken by the kernel */
    unsigned inflight; /* taken by the kernel, not yet reaped */
    unsigned flags;    /* setup flags the kernel accepted */
    unsigned gen;      /* process generation (fork guard) */
    int reg_gen;       /* an engine's ring: the registration generation it carries */
};
#endif

#endif
