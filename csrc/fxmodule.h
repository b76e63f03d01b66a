/* Python-facing pieces of the C core: what module.c (the engine, its
 * types and functions) gives gpu.c (the GPU pipeline, which drives the
 * same engines), and what init.c puts together. Include after Python.h. */
#ifndef FXMODULE_H
#define FXMODULE_H

#include "fxio.h"

/* Marks an Engine in use (so close() waits); -1 with an exception set when
 * it is closed or not an Engine. Pair with fx_engine_end. */
int fx_engine_begin(PyObject *engine);
void fx_engine_end(PyObject *engine);
/* fx_engine_begin without the GIL or an exception: 0, or -1 (closed, not
 * initialised, a forked child). Pair with fx_engine_end. */
int fx_engine_hold(PyObject *engine);
/* The engine's io_uring, or NULL for the thread engine. */
fx_uring *fx_engine_uring(PyObject *engine);
/* The thread engine's pool, or NULL for the io_uring engine. */
fx_pool *fx_engine_pool(PyObject *engine);
uint64_t fx_engine_split_bytes(PyObject *engine);
unsigned fx_engine_queue_depth(PyObject *engine);

/* PySequence_Fast, except that a list comes back as a tuple of its items:
 * parsing an item may run Python code (a name's __fspath__, a number's
 * __index__) that changes the caller's list while it is walked. */
PyObject *fx_sequence_snapshot(PyObject *seq, const char *message);

/* csrc/module.c: the _fxio module with the core's types, functions and
 * constants; NULL with an exception set. */
PyObject *fx_core_module_create(void);
/* csrc/gpu.c: adds the GPU staging/DMA types and functions; 0 or -1. */
int fx_gpu_module_init(PyObject *module);

#endif
