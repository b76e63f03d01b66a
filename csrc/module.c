/* lmcache_fx._fxio: the Python face of the C core.
 *
 * Engine.read/write take a list of (fd, offset, length, address) and run the
 * batch with the GIL released; Engine.submit runs it on a C thread (a
 * runner kept between batches: runner.c) and signals an eventfd, so asyncio
 * code can await it. HostBuffer is aligned
 * anonymous memory (huge pages when large) for headers and staging.
 *
 * Fork: an Engine, Batch or HostBuffer belongs to the process that made it.
 * In a forked child (no I/O threads, the parent's rings, HostBuffer memory
 * not mapped: MADV_DONTFORK) every use raises RuntimeError; close() and
 * destruction there leave the parent's resources alone.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <string.h>
#include <stdio.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fxmodule.h"

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

enum { KIND_THREADS = 0, KIND_URING = 1 };

#define FORK_MSG(what)                                                                             \
    "lmcache-fx " what " was created in another process (fork); create a new " what " in the child"


typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t idle_cv;
    int users;  /* calls running with the GIL released */
    int closed;
    int kind;
    unsigned queue_depth;
    uint64_t split_bytes;
    int staged; /* reads from memory go through a staging buffer (batch.c, run_staged) */
    int nthreads;
    int runner_nice; /* submitted batches' runners run this many priority steps below the submitter */
    fx_uring *uring;
    fx_pool *pool;
    fx_pool *openers; /* io_uring engine: threads that open chunk files (read_chunks) */
    fx_pool *writers; /* io_uring engine: threads that write chunk files (write_chunks), apart from the openers */
    PyObject *fallback_reason; /* str, or None when the asked engine runs */
    unsigned gen;              /* process generation (fork guard) */
    /* register_buffer(obj): the export of the registered memory, held until
     * it is replaced, cleared or the engine closes, so the memory cannot be
     * freed (and another buffer mapped at its address, which READ_FIXED
     * would then read into the old pinned pages) while registered. */
    Py_buffer reg_view;
    int reg_held;
    /* Serialises register_buffer calls from the ring call to the swap of
     * reg_view (taken without the GIL; never held while waiting for mu). */
    pthread_mutex_t reg_mu;
    /* Submitted batches beyond max_running wait here (under mu), oldest
     * first, and are run in arrival order by the runners that finish (at
     * that runner's priority): more batches at once than CPUs only makes
     * them overtake each other, and the requests waiting on them finish
     * out of order (docs/benchmarks.md, "Awaited reads in arrival order"). */
    int max_running; /* 0: no bound */
    int whole;       /* small payloads whole when other submitted batches run or wait */
    int running;
    struct BatchObject *pend_head, *pend_tail;
    int initialising; /* __init__ is running (it drops the GIL): a second call is refused */
} EngineObject;

static PyTypeObject EngineType;
static void release_registered(EngineObject *self);
static PyTypeObject BatchType;
static PyTypeObject NotifierType;
static PyTypeObject HostBufferType;

/* ---------------------------------------------------------------- helpers */

/* Counts one more user unless the engine is closed; 1 when counted. */
static int add_user(EngineObject *e)
{
    int ok;

    pthread_mutex_lock(&e->mu);
    ok = !e->closed;
    if (ok)
        e->users++;
    pthread_mutex_unlock(&e->mu);
    return ok;
}

static int begin_use(EngineObject *e)
{
    if (FX_FORKED(e->gen)) { /* before the lock: a parent thread may hold it */
        PyErr_SetString(PyExc_RuntimeError, FORK_MSG("Engine"));
        return -1;
    }
    if (e->kind < 0) {
        PyErr_SetString(PyExc_ValueError, "engine is not initialised (Engine.__init__ did not run)");
        return -1;
    }
    if (add_user(e))
        return 0;
    PyErr_SetString(PyExc_ValueError, "engine is closed");
    return -1;
}

static void end_use(EngineObject *e)
{
    pthread_mutex_lock(&e->mu);
    if (--e->users == 0)
        pthread_cond_broadcast(&e->idle_cv);
    pthread_mutex_unlock(&e->mu);
}

int fx_engine_begin(PyObject *engine)
{
    if (!PyObject_TypeCheck(engine, &EngineType)) {
        PyErr_SetString(PyExc_TypeError, "expected an lmcache_fx._fxio.Engine");
        return -1;
    }
    return begin_use((EngineObject *)engine);
}

void fx_engine_end(PyObject *engine) { end_use((EngineObject *)engine); }

int fx_engine_hold(PyObject *engine)
{
    EngineObject *e = (EngineObject *)engine;

    if (FX_FORKED(e->gen) || e->kind < 0)
        return -1;
    return add_user(e) ? 0 : -1;
}

fx_uring *fx_engine_uring(PyObject *engine)
{
    EngineObject *e = (EngineObject *)engine;
    return e->kind == KIND_URING ? e->uring : NULL;
}

fx_pool *fx_engine_pool(PyObject *engine)
{
    EngineObject *e = (EngineObject *)engine;
    return e->kind == KIND_URING ? NULL : e->pool;
}

uint64_t fx_engine_split_bytes(PyObject *engine) { return ((EngineObject *)engine)->split_bytes; }
unsigned fx_engine_queue_depth(PyObject *engine) { return ((EngineObject *)engine)->queue_depth; }

static fx_pool *chunk_openers(EngineObject *e, int *width);

/* Whether every piece of a batch is a read served from memory (tmpfs and
 * the like: fx_piece.mem). */
static int memory_reads(const fx_batch *b)
{
    if (b->write || b->npieces == 0)
        return 0;
    for (size_t i = 0; i < b->npieces; i++)
        if (!b->pieces[i].mem)
            return 0;
    return 1;
}

/* Runs a prepared batch; no GIL. A batch read wholly from memory runs on
 * threads even in the io_uring engine: there io_uring only hands each copy
 * to an io-wq worker, and the CRC then runs cold on the reaping thread,
 * where a pool thread checksums each piece right after copying it, while it
 * is still in cache (tmpfs, 7 x 64 MiB: docs/benchmarks.md). */
static int engine_run(EngineObject *e, fx_batch *b)
{
    b->staged = e->staged;
    if (e->kind == KIND_URING) {
        int width;
        fx_pool *pool = memory_reads(b) ? chunk_openers(e, &width) : NULL;

        if (pool)
            return fx_pool_run(pool, b, (int)e->queue_depth);
        return fx_uring_run(e->uring, b);
    }
    return fx_pool_run(e->pool, b, (int)e->queue_depth);
}

PyObject *fx_sequence_snapshot(PyObject *seq, const char *message)
{
    PyObject *fast = PySequence_Fast(seq, message), *items;

    if (!fast || !PyList_Check(fast))
        return fast;
    items = PyList_AsTuple(fast);
    Py_DECREF(fast);
    return items;
}

/* Parses a sequence of (fd, offset, length, address) into a new array. */
static fx_op *parse_ops(PyObject *seq_in, size_t *n_out)
{
    PyObject *seq = fx_sequence_snapshot(seq_in, "ops must be a sequence of (fd, offset, length, address)");
    Py_ssize_t n, i;
    fx_op *ops;

    if (!seq)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    ops = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*ops));
    if (!ops) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        long long fd, off, len;
        unsigned long long addr;

        if (!PyArg_ParseTuple(item, "LLLK;each op is (fd, offset, length, address)", &fd, &off,
                              &len, &addr))
            goto fail;
        if (fd < 0 || fd > INT32_MAX || off < 0 || len < 0) {
            PyErr_Format(PyExc_ValueError, "op %zd: fd, offset and length must be >= 0", i);
            goto fail;
        }
        if (len > 0 && addr == 0) {
            PyErr_Format(PyExc_ValueError, "op %zd: address is NULL", i);
            goto fail;
        }
        ops[i].fd = (int)fd;
        ops[i].offset = (uint64_t)off;
        ops[i].length = (uint64_t)len;
        ops[i].buf = (char *)(uintptr_t)addr;
    }
    Py_DECREF(seq);
    *n_out = (size_t)n;
    return ops;
fail:
    Py_DECREF(seq);
    PyMem_Free(ops);
    return NULL;
}

/* parse_ops, and a zeroed result per op: 0, or -1 with an exception set and
 * nothing left allocated. */
static int parse_ops_results(PyObject *seq, fx_op **ops, fx_result **res, size_t *n)
{
    if (!(*ops = parse_ops(seq, n)))
        return -1;
    if (!(*res = PyMem_Calloc(*n ? *n : 1, sizeof(**res)))) {
        PyMem_Free(*ops);
        *ops = NULL;
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* A split argument: 0 (the default) or a multiple of 4096 up to 1 GiB; -1
 * with ValueError otherwise. */
static int check_split(unsigned long long split)
{
    if (split > (1ull << 30) || split % FX_DIO_ALIGN) {
        PyErr_Format(PyExc_ValueError, "split must be 0 or a multiple of 4096 up to 1 GiB, not %llu", split);
        return -1;
    }
    return 0;
}

static PyObject *results_to_list(const fx_result *res, size_t n, int want_crc)
{
    PyObject *out = PyList_New((Py_ssize_t)n);
    if (!out)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        PyObject *v = want_crc ? Py_BuildValue("(LI)", (long long)res[i].result, res[i].crc)
                               : PyLong_FromLongLong(res[i].result);
        if (!v) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    return out;
}

/* ----------------------------------------------------------------- Engine */

static int engine_init(EngineObject *self, PyObject *args, PyObject *kw);

/* __init__ called again from another thread while the first call has the GIL
 * released would pass the "already initialised" check and overwrite (leak)
 * the first call's ring or threads. */
static int Engine_init(EngineObject *self, PyObject *args, PyObject *kw)
{
    int r;

    if (self->initialising) {
        PyErr_SetString(PyExc_RuntimeError, "Engine is being initialised by another call");
        return -1;
    }
    self->initialising = 1;
    r = engine_init(self, args, kw);
    self->initialising = 0;
    return r;
}

static int engine_init(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"io_engine",   "queue_depth", "split_bytes", "threads", "staged",
                             "runner_nice", "max_running", "whole_when_busy", NULL};
    const char *engine = "auto";
    long long qd = 32, split = 1 << 20;
    int threads = 0, staged = 1, runner_nice = 0, max_running = 0, whole = 1;
    char why[256] = "";

    if (self->kind >= 0 && (self->uring || self->pool || self->closed)) {
        /* closed: its threads would start again under an engine every call refuses */
        PyErr_SetString(PyExc_RuntimeError,
                        self->closed ? "Engine is closed; make a new one" : "Engine is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|sLLipiip", kwlist, &engine, &qd, &split, &threads, &staged,
                                     &runner_nice, &max_running, &whole))
        return -1;
    self->staged = staged;
    if (strcmp(engine, "auto") && strcmp(engine, "io_uring") && strcmp(engine, "threads")) {
        PyErr_Format(PyExc_ValueError, "io_engine must be 'auto', 'io_uring' or 'threads', not '%s'",
                     engine);
        return -1;
    }
    if (qd < 1 || qd > 32768) {
        PyErr_Format(PyExc_ValueError, "queue_depth must be in 1..32768, not %lld", qd);
        return -1;
    }
    if (split < (long long)FX_DIO_ALIGN || split > (1ll << 30) || split % FX_DIO_ALIGN) {
        PyErr_Format(PyExc_ValueError,
                     "split_bytes must be a multiple of 4096 between 4096 and 1 GiB, not %lld",
                     split);
        return -1;
    }
    if (threads < 0 || threads > 1024) {
        PyErr_Format(PyExc_ValueError, "threads must be in 0..1024, not %d", threads);
        return -1;
    }
    if (runner_nice < 0 || runner_nice > 19) {
        PyErr_Format(PyExc_ValueError, "runner_nice must be in 0..19, not %d", runner_nice);
        return -1;
    }
    if (max_running < 0 || max_running > 1024) {
        PyErr_Format(PyExc_ValueError, "max_running must be in 0..1024, not %d", max_running);
        return -1;
    }
    self->runner_nice = runner_nice;
    self->max_running = max_running;
    self->whole = whole;
    {
        const char *spec = getenv("LMCACHE_FX_FAULT");
        if (fx_fault_setup(spec, why, sizeof(why)) < 0) {
            PyErr_SetString(PyExc_ValueError, why);
            return -1;
        }
        why[0] = 0;
    }
    self->gen = fx_fork_gen;
    self->queue_depth = (unsigned)qd;
    self->split_bytes = (uint64_t)split;
    Py_XSETREF(self->fallback_reason, Py_NewRef(Py_None));

    if (strcmp(engine, "threads") != 0) {
        Py_BEGIN_ALLOW_THREADS
        self->uring = fx_uring_create((unsigned)qd, why, sizeof(why));
        Py_END_ALLOW_THREADS
        if (self->uring) {
            self->kind = KIND_URING;
            if (runner_nice > 0) {
                /* The openers' threads (opens, memory reads, spread checksums)
                 * serve blocking and awaited reads alike: started here, at the
                 * priority of the engine's creator, not at a runner's lower one,
                 * as they would be if an awaited read were the first to need them. */
                int width;
                Py_BEGIN_ALLOW_THREADS
                (void)chunk_openers(self, &width);
                Py_END_ALLOW_THREADS
            }
            return 0;
        }
        if (strcmp(engine, "io_uring") == 0) {
            PyErr_Format(PyExc_OSError, "io_engine='io_uring' cannot be used: %s", why);
            return -1;
        }
        Py_XSETREF(self->fallback_reason, PyUnicode_FromString(why));
        if (!self->fallback_reason)
            return -1;
    }
    self->nthreads = threads ? threads : (qd < 16 ? (int)qd : 16);
    Py_BEGIN_ALLOW_THREADS
    self->pool = fx_pool_create(self->nthreads);
    Py_END_ALLOW_THREADS
    if (!self->pool) {
        PyErr_SetString(PyExc_OSError, "could not start the I/O threads");
        return -1;
    }
    self->nthreads = fx_pool_nthreads(self->pool);
    self->kind = KIND_THREADS;
    return 0;
}

static PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    EngineObject *self = (EngineObject *)type->tp_alloc(type, 0);
    (void)args;
    (void)kw;
    if (!self)
        return NULL;
    pthread_mutex_init(&self->mu, NULL);
    pthread_mutex_init(&self->reg_mu, NULL);
    pthread_cond_init(&self->idle_cv, NULL);
    self->kind = -1;
    self->gen = fx_fork_gen;
    return (PyObject *)self;
}

/* Waits for running calls, then frees the rings and threads. */
static void engine_shutdown(EngineObject *self)
{
    fx_uring *u;
    fx_pool *p, *o, *w;

    if (FX_FORKED(self->gen)) {
        /* A forked child's copy: its lock, users count, threads and rings
         * are the parent's. Forget them; nothing here can run on them. */
        self->closed = 1;
        self->uring = NULL;
        self->pool = NULL;
        self->openers = NULL;
        self->writers = NULL;
        return;
    }
    pthread_mutex_lock(&self->mu);
    self->closed = 1;
    while (self->users)
        pthread_cond_wait(&self->idle_cv, &self->mu);
    u = self->uring;
    p = self->pool;
    o = self->openers;
    w = self->writers;
    self->uring = NULL;
    self->pool = NULL;
    self->openers = NULL;
    self->writers = NULL;
    pthread_mutex_unlock(&self->mu);
    fx_uring_destroy(u);
    fx_pool_destroy(p);
    fx_pool_destroy(o);
    fx_pool_destroy(w);
}

static PyObject *Engine_close(EngineObject *self, PyObject *unused)
{
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    engine_shutdown(self);
    Py_END_ALLOW_THREADS
    release_registered(self);
    Py_RETURN_NONE;
}

static void Engine_dealloc(EngineObject *self)
{
    int forked = FX_FORKED(self->gen);

    engine_shutdown(self); /* no users can remain: they hold references */
    release_registered(self);
    if (!forked) {
        pthread_cond_destroy(&self->idle_cv);
        pthread_mutex_destroy(&self->mu);
        pthread_mutex_destroy(&self->reg_mu);
    }
    Py_XDECREF(self->fallback_reason);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* io_uring: the threads that may checksum a batch's landed pieces beside its
 * reaping thread (the openers' pool). */
static void crc_helpers(EngineObject *e, fx_batch *b)
{
    if (b->want_crc && e->kind == KIND_URING)
        b->crc_pool = chunk_openers(e, &b->crc_width);
}

static PyObject *engine_rw(EngineObject *self, PyObject *args, PyObject *kw, int write)
{
    static char *kwlist[] = {"ops", "crc", "split", "stage", NULL};
    PyObject *ops_obj, *out = NULL;
    int want_crc = 0, stage = 0, r = 0;
    unsigned long long split = 0;
    fx_batch b = {0};
    fx_op *ops;
    fx_result *res;
    size_t n = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|pKp", kwlist, &ops_obj, &want_crc, &split, &stage))
        return NULL;
    if (check_split(split) < 0 || parse_ops_results(ops_obj, &ops, &res, &n) < 0)
        return NULL;
    if (begin_use(self) < 0)
        goto done;
    b.ops = ops;
    b.nops = n;
    b.res = res;
    b.write = write;
    b.want_crc = want_crc;
    b.stage_direct = stage; /* reads only: the engine stages no write */
    Py_BEGIN_ALLOW_THREADS
    crc_helpers(self, &b);
    r = fx_batch_prepare(&b, split ? split : self->split_bytes);
    if (r == 0)
        r = engine_run(self, &b);
    fx_batch_release(&b);
    Py_END_ALLOW_THREADS
    end_use(self);
    /* Only a failure to start (no memory for the batch, offsets and lengths
     * out of range) raises; a ring that failed midway has put an error on
     * each op it did not finish. */
    if (r == -EOWNERDEAD) {
        PyErr_SetString(PyExc_RuntimeError, FORK_MSG("Engine"));
        goto done;
    }
    if (r == -ENOMEM || r == -EINVAL) {
        errno = -r;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    out = results_to_list(res, n, want_crc);
done:
    PyMem_Free(ops);
    PyMem_Free(res);
    return out;
}

static PyObject *Engine_read(EngineObject *self, PyObject *args, PyObject *kw)
{
    return engine_rw(self, args, kw, 0);
}

static PyObject *Engine_write(EngineObject *self, PyObject *args, PyObject *kw)
{
    return engine_rw(self, args, kw, 1);
}

static void release_registered(EngineObject *self)
{
    if (self->reg_held) {
        self->reg_held = 0;
        PyBuffer_Release(&self->reg_view);
    }
}

static PyObject *Engine_register_buffer(EngineObject *self, PyObject *args)
{
    PyObject *what;
    unsigned long long addr, len = 0;
    Py_buffer view;
    Py_buffer old;
    int r = -ENOSYS, have_view = 0, still, release_old = 0, len_given = PyTuple_GET_SIZE(args) > 1;

    if (!PyArg_ParseTuple(args, "O|K", &what, &len))
        return NULL;
    if (PyLong_Check(what)) {
        /* Foreign memory (a torch tensor, LMCache's pool): its owner clears
         * the registration before freeing it. */
        if (!len_given) {
            PyErr_SetString(PyExc_TypeError, "register_buffer(address, length): the length is missing");
            return NULL;
        }
        addr = PyLong_AsUnsignedLongLong(what);
        if (PyErr_Occurred())
            return NULL;
        /* Past the address space the ring's iovec count wraps to 0: nothing
         * registered, and 0 (success) returned. */
        if (len > (unsigned long long)PTRDIFF_MAX || addr + len < addr) {
            PyErr_Format(PyExc_ValueError, "register_buffer: %llu bytes at %p run past the address space", len,
                         (void *)(uintptr_t)addr);
            return NULL;
        }
    } else {
        if (PyObject_GetBuffer(what, &view, PyBUF_WRITABLE) < 0)
            return NULL;
        have_view = 1;
        addr = (uintptr_t)view.buf;
        if (!len_given)
            len = (unsigned long long)view.len;
        if (len > (unsigned long long)view.len || !addr) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "register_buffer: length beyond the buffer");
            return NULL;
        }
    }
    if (begin_use(self) < 0) {
        if (have_view)
            PyBuffer_Release(&view);
        return NULL;
    }
    if (self->kind != KIND_URING) {
        end_use(self);
        if (have_view)
            PyBuffer_Release(&view);
        return PyLong_FromLong(r);
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->reg_mu);
    r = fx_uring_register(self->uring, (void *)(uintptr_t)addr, (size_t)len);
    still = fx_uring_registered(self->uring);
    Py_END_ALLOW_THREADS
    end_use(self);
    /* Success: the region holds the new memory (or none). A failure may
     * leave the old registration in place (no ring to register with):
     * its buffer is held on until the region really changes. Exports are
     * released after reg_mu (a release may run Python code). */
    if ((r == 0 || !still) && self->reg_held) {
        old = self->reg_view;
        self->reg_held = 0;
        release_old = 1;
    }
    if (have_view && r == 0 && len) {
        self->reg_view = view;
        self->reg_held = 1;
        have_view = 0;
    }
    pthread_mutex_unlock(&self->reg_mu);
    if (release_old)
        PyBuffer_Release(&old);
    if (have_view)
        PyBuffer_Release(&view);
    return PyLong_FromLong(r);
}

/* ------------------------------------------------------------ read_chunks */

/* Parsed arguments of read_chunks / submit_chunks; names and expected bodies
 * are copied so the call runs without the GIL or the caller's objects. */
typedef struct {
    fx_chunk *c;
    fx_chunk_result *res;
    char *arena;
    size_t n;
    char *scratch;
    int verify, direct, lock, mapped, stage;
} chunk_args;

static void chunk_args_free(chunk_args *a)
{
    PyMem_Free(a->c);
    PyMem_Free(a->res);
    PyMem_Free(a->arena);
    memset(a, 0, sizeof(*a));
}

/* Appends len bytes (and a NUL) to the arena; the offset, or -1. */
static Py_ssize_t arena_put(char **arena, size_t *used, size_t *cap, const char *p, size_t len)
{
    size_t off = *used;

    if (*used + len + 1 > *cap) {
        size_t ncap = (*cap ? *cap * 2 : 4096);
        char *na;
        while (ncap < *used + len + 1)
            ncap *= 2;
        na = PyMem_Realloc(*arena, ncap);
        if (!na) {
            PyErr_NoMemory();
            return -1;
        }
        *arena = na;
        *cap = ncap;
    }
    memcpy(*arena + off, p, len);
    (*arena)[off + len] = 0;
    *used += len + 1;
    return (Py_ssize_t)off;
}

static int parse_chunks(PyObject *seq_in, unsigned long long scratch, chunk_args *a)
{
    PyObject *seq = fx_sequence_snapshot(
        seq_in, "chunks must be a sequence of (dir_fd, name, address, length[, expect])");
    Py_ssize_t n, i;
    size_t used = 0, cap = 0;
    Py_ssize_t *name_off = NULL, *exp_off = NULL;

    if (!seq)
        return -1;
    n = PySequence_Fast_GET_SIZE(seq);
    if (n > 0 && (scratch == 0 || scratch % FX_DIO_ALIGN)) {
        PyErr_SetString(PyExc_ValueError,
                        "scratch must be a 4096-aligned address of len(chunks) * 4096 bytes");
        goto fail;
    }
    a->n = (size_t)n;
    a->scratch = (char *)(uintptr_t)scratch;
    a->c = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*a->c));
    a->res = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*a->res));
    name_off = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*name_off));
    exp_off = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*exp_off));
    if (!a->c || !a->res || !name_off || !exp_off) {
        PyErr_NoMemory();
        goto fail;
    }
    for (i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *name = NULL, *expect = Py_None;
        PyObject *nb = NULL;
        long long fd, len;
        unsigned long long addr;
        char *s;
        Py_ssize_t slen;

        if (!PyArg_ParseTuple(item, "LOKL|O;each chunk is (dir_fd, name, address, length[, expect])",
                              &fd, &name, &addr, &len, &expect))
            goto fail;
        if (fd < 0 || fd > INT32_MAX || len < 0) {
            PyErr_Format(PyExc_ValueError, "chunk %zd: dir_fd and length must be >= 0", i);
            goto fail;
        }
        if (len > 0 && addr == 0) {
            PyErr_Format(PyExc_ValueError, "chunk %zd: address is NULL", i);
            goto fail;
        }
        if (!PyUnicode_FSConverter(name, &nb))
            goto fail;
        s = PyBytes_AS_STRING(nb);
        slen = PyBytes_GET_SIZE(nb);
        if (slen == 0) {
            Py_DECREF(nb);
            PyErr_Format(PyExc_ValueError, "chunk %zd: empty name", i);
            goto fail;
        }
        name_off[i] = arena_put(&a->arena, &used, &cap, s, (size_t)slen);
        Py_DECREF(nb);
        if (name_off[i] < 0)
            goto fail;
        exp_off[i] = -1;
        if (expect != Py_None) {
            if (!PyBytes_Check(expect)) {
                PyErr_Format(PyExc_TypeError, "chunk %zd: expect must be bytes or None", i);
                goto fail;
            }
            if (PyBytes_GET_SIZE(expect) > (Py_ssize_t)FX_HDR_SIZE) {
                PyErr_Format(PyExc_ValueError, "chunk %zd: expect is longer than a header", i);
                goto fail;
            }
            exp_off[i] = arena_put(&a->arena, &used, &cap, PyBytes_AS_STRING(expect),
                                   (size_t)PyBytes_GET_SIZE(expect));
            if (exp_off[i] < 0)
                goto fail;
            a->c[i].expect_len = (uint32_t)PyBytes_GET_SIZE(expect);
        }
        a->c[i].dirfd = (int)fd;
        a->c[i].dest = (char *)(uintptr_t)addr;
        a->c[i].length = (uint64_t)len;
    }
    for (i = 0; i < n; i++) { /* the arena has stopped moving */
        a->c[i].name = a->arena + name_off[i];
        a->c[i].expect = exp_off[i] >= 0 ? a->arena + exp_off[i] : NULL;
    }
    PyMem_Free(name_off);
    PyMem_Free(exp_off);
    Py_DECREF(seq);
    return 0;
fail:
    PyMem_Free(name_off);
    PyMem_Free(exp_off);
    Py_DECREF(seq);
    chunk_args_free(a);
    return -1;
}

/* ------------------------------------------------------------ stat_beneath */

/* Item i's name (str or bytes, a filesystem path) copied into the arena of a
 * batch that runs without the GIL: its offset there, or -1 with the error
 * set (an embedded NUL would cut the name short). Store names are ASCII and
 * make no bytes object. */
static Py_ssize_t arena_put_name(char **arena, size_t *used, size_t *cap, PyObject *name, Py_ssize_t i)
{
    PyObject *nb = NULL;
    const char *p;
    Py_ssize_t len, off;

    if (PyUnicode_Check(name) && PyUnicode_IS_ASCII(name)) {
        p = PyUnicode_AsUTF8AndSize(name, &len);
    } else {
        if (!PyUnicode_FSConverter(name, &nb))
            return -1;
        p = PyBytes_AS_STRING(nb);
        len = PyBytes_GET_SIZE(nb);
    }
    if (!p || (Py_ssize_t)strlen(p) != len) {
        Py_XDECREF(nb);
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "item %zd: embedded null byte in name", i);
        return -1;
    }
    off = arena_put(arena, used, cap, p, (size_t)len);
    Py_XDECREF(nb);
    return off;
}

typedef struct {
    struct stat st;
    int err; /* 0, -errno, or 1: not looked at (after the first miss) */
} stat_one;

/* stat_beneath(items, stop_at_missing=False): the lstat of each (dir_fd,
 * name), no symlink followed on the way, in one call without the GIL: a
 * lookup of a prompt's chunks costs a syscall loop here, not a Python loop
 * of opens, stats and closes. Each answer is None (absent, refused, or not
 * looked at) or (st_mode, st_size, st_mtime_ns, st_dev, st_ino). With
 * stop_at_missing, the names after the first that is not a regular file are
 * not looked at (a prefix lookup stops there). */
static PyObject *mod_stat_beneath(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"items", "stop_at_missing", NULL};
    PyObject *items, *seq, *out = NULL;
    int stop = 0;
    Py_ssize_t n, i;
    size_t used = 0, cap = 0;
    char *arena = NULL;
    Py_ssize_t *off = NULL;
    int *fds = NULL;
    stat_one *res = NULL;

    (void)m;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|p", kwlist, &items, &stop))
        return NULL;
    if (!(seq = fx_sequence_snapshot(items, "items must be a sequence of (dir_fd, name)")))
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    off = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*off));
    fds = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*fds));
    res = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*res));
    if (!off || !fds || !res) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < n; i++) {
        PyObject *name;

        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "iO;each item is (dir_fd, name)", &fds[i], &name))
            goto done;
        if ((off[i] = arena_put_name(&arena, &used, &cap, name, i)) < 0)
            goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++) {
        res[i].err = fx_stat_beneath(fds[i], arena + off[i], &res[i].st);
        if (stop && (res[i].err < 0 || !S_ISREG(res[i].st.st_mode))) {
            while (++i < n)
                res[i].err = 1;
        }
    }
    Py_END_ALLOW_THREADS
    if (!(out = PyList_New(n)))
        goto done;
    for (i = 0; i < n; i++) {
        const struct stat *st = &res[i].st;
        PyObject *v = res[i].err ? Py_NewRef(Py_None)
                                 : Py_BuildValue("(iLLKK)", (int)st->st_mode, (long long)st->st_size,
                                                 (long long)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec,
                                                 (unsigned long long)st->st_dev,
                                                 (unsigned long long)st->st_ino);
        if (!v) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
    }
done:
    PyMem_Free(arena);
    PyMem_Free(off);
    PyMem_Free(fds);
    PyMem_Free(res);
    Py_DECREF(seq);
    return out;
}

/* utime_beneath(items): sets atime and mtime of each (dir_fd, name,
 * mtime_ns) to mtime_ns, no symlink followed on the way (as reads open), in
 * one call without the GIL: the store's shared LRU clock for a batch of
 * chunks, where Python set it one file at a time. Returns how many failed
 * (the clock is advisory: a chunk gone meanwhile is no error). */
static PyObject *mod_utime_beneath(PyObject *m, PyObject *items)
{
    PyObject *seq, *out = NULL;
    Py_ssize_t n, i, failed = 0;
    size_t used = 0, cap = 0;
    char *arena = NULL;
    Py_ssize_t *off = NULL;
    int *fds = NULL;
    long long *ns = NULL;

    (void)m;
    if (!(seq = fx_sequence_snapshot(items, "items must be a sequence of (dir_fd, name, mtime_ns)")))
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    off = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*off));
    fds = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*fds));
    ns = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*ns));
    if (!off || !fds || !ns) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < n; i++) {
        PyObject *name;

        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "iOL;each item is (dir_fd, name, mtime_ns)", &fds[i],
                              &name, &ns[i]))
            goto done;
        if ((off[i] = arena_put_name(&arena, &used, &cap, name, i)) < 0)
            goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++)
        if (fx_utime_beneath(fds[i], arena + off[i], ns[i]) < 0)
            failed++;
    Py_END_ALLOW_THREADS
    out = PyLong_FromSsize_t(failed);
done:
    PyMem_Free(arena);
    PyMem_Free(off);
    PyMem_Free(fds);
    PyMem_Free(ns);
    Py_DECREF(seq);
    return out;
}

/* rename_noreplace(dir_fd, src, dst): renames src to dst within the directory
 * dir_fd only where dst does not exist (renameat2 RENAME_NOREPLACE), without
 * the GIL: a store's commit learns that nothing was replaced from the rename
 * itself instead of a stat of dst first. OSError: EEXIST where dst exists,
 * EINVAL or ENOSYS where the filesystem or kernel has no such rename. */
static PyObject *mod_rename_noreplace(PyObject *m, PyObject *args)
{
    PyObject *src_name, *dst_name, *src = NULL, *dst = NULL, *out = NULL;
    int dfd, r, err = 0;

    (void)m;
    if (!PyArg_ParseTuple(args, "iOO:rename_noreplace", &dfd, &src_name, &dst_name) ||
        !PyUnicode_FSConverter(src_name, &src) || !PyUnicode_FSConverter(dst_name, &dst))
        goto done;
    Py_BEGIN_ALLOW_THREADS
    r = renameat2(dfd, PyBytes_AS_STRING(src), dfd, PyBytes_AS_STRING(dst), RENAME_NOREPLACE);
    if (r < 0)
        err = errno;
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, dst_name);
        goto done;
    }
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(src);
    Py_XDECREF(dst);
    return out;
}

static int run_engine_cb(void *ctx, fx_batch *b) { return engine_run((EngineObject *)ctx, b); }

/* Side pools of chunk work: the thread engine's own threads; for io_uring
 * a few of their own per kind of work (openers, writers), each started on
 * first use (the openers when the engine is made, with runner_nice above 0).
 * A cold open waits for its inode to be read, so opens run in parallel as
 * the reads do. */
#define OPENERS_MAX 8

static fx_pool *engine_side_pool(EngineObject *e, fx_pool **slot, int *width)
{
    fx_pool *p;
    int closed;

    if (e->kind == KIND_THREADS) {
        *width = e->nthreads;
        return e->pool;
    }
    *width = e->queue_depth < OPENERS_MAX ? (int)e->queue_depth : OPENERS_MAX;
    if (*width < 2 || FX_FORKED(e->gen)) /* forked: a parent thread may hold mu; the caller refuses later */
        return NULL;
    pthread_mutex_lock(&e->mu);
    p = *slot;
    closed = e->closed;
    pthread_mutex_unlock(&e->mu);
    if (!p && !closed) {
        /* Started outside mu: thread creation is slow, and every user of the engine takes mu. */
        fx_pool *made = fx_pool_create(*width);

        pthread_mutex_lock(&e->mu);
        if (!*slot && !e->closed) {
            *slot = made;
            made = NULL;
        }
        p = *slot;
        pthread_mutex_unlock(&e->mu);
        fx_pool_destroy(made); /* another thread's got there first, or the engine closed */
    }
    if (p)
        *width = fx_pool_nthreads(p);
    return p; /* NULL (no threads to be had): the work runs on the calling thread */
}

static fx_pool *chunk_openers(EngineObject *e, int *width) { return engine_side_pool(e, &e->openers, width); }

/* write_chunks' threads: on the io_uring engine a pool apart from the
 * openers, so a store's blocking payload writes do not hold up the opens
 * (and memory copies, and checksums) of loads running beside it. */
static fx_pool *chunk_writers(EngineObject *e, int *width) { return engine_side_pool(e, &e->writers, width); }

static int chunks_run(EngineObject *e, chunk_args *a, int whole, const atomic_int *stop)
{
    int width = 1;
    fx_pool *openers = a->n > 1 ? chunk_openers(e, &width) : NULL;

    return fx_chunks_read(a->c, a->n, a->scratch,
                          (a->direct ? FX_OPEN_DIRECT : 0) | (a->lock ? FX_OPEN_LOCK : 0) | (a->mapped ? FX_OPEN_MAP : 0) |
                              (a->stage ? FX_OPEN_STAGE : 0) | (whole ? FX_OPEN_WHOLE : 0),
                          a->verify, e->split_bytes,
                          run_engine_cb, e, openers, width, stop, a->res);
}

static PyObject *chunk_results_to_list(const chunk_args *a)
{
    PyObject *out = PyList_New((Py_ssize_t)a->n);

    if (!out)
        return NULL;
    for (size_t i = 0; i < a->n; i++) {
        const fx_chunk_result *r = &a->res[i];
        PyObject *v = Py_BuildValue("(LLKKL)", (long long)r->status, (long long)r->nbytes,
                                    (unsigned long long)r->dev, (unsigned long long)r->ino,
                                    (long long)r->size);
        if (!v) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    return out;
}

/* A run's own failure (not a chunk's): raises and returns -1. */
static int chunks_raise(int r)
{
    if (r == -EOWNERDEAD) {
        PyErr_SetString(PyExc_RuntimeError, FORK_MSG("Engine"));
        return -1;
    }
    if (r < 0) {
        errno = -r;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static char *chunk_kwlist[] = {"chunks", "scratch", "verify", "direct", "lock", "mapped", "stage", NULL};

/* This thread's last read_chunks call: ns in the engine, and ns from the
 * engine's return to holding the GIL again (the wait behind other Python
 * threads: what a request waits for after its bytes are in). For probes. */
static __thread uint64_t last_engine_ns, last_gil_ns;

static PyObject *Engine_read_chunks(EngineObject *self, PyObject *args, PyObject *kw)
{
    uint64_t t0, t1;
    PyObject *chunks, *out = NULL;
    unsigned long long scratch;
    chunk_args a;
    int r;

    memset(&a, 0, sizeof(a));
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OK|ppppp", chunk_kwlist, &chunks, &scratch, &a.verify,
                                     &a.direct, &a.lock, &a.mapped, &a.stage))
        return NULL;
    if (parse_chunks(chunks, scratch, &a) < 0)
        return NULL;
    if (begin_use(self) < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    t0 = fx_now_ns();
    r = chunks_run(self, &a, 0, NULL);
    t1 = fx_now_ns();
    Py_END_ALLOW_THREADS
    last_engine_ns = t1 - t0;
    last_gil_ns = fx_now_ns() - t1;
    end_use(self);
    if (chunks_raise(r) == 0)
        out = chunk_results_to_list(&a);
done:
    chunk_args_free(&a);
    return out;
}

/* ----------------------------------------------------------- write_chunks */

static PyObject *Engine_write_chunks(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"chunks", "direct", NULL};
    PyObject *chunks, *seq, *out = NULL;
    int direct = 0, r, width = 1;
    fx_wchunk *c;
    fx_wchunk_result *res;
    Py_ssize_t n, i;
    fx_pool *pool;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|p", kwlist, &chunks, &direct))
        return NULL;
    seq = fx_sequence_snapshot(chunks,
                               "chunks must be a sequence of (fd, address, length, header_address, mtime_ns)");
    if (!seq)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    c = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*c));
    res = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*res));
    if (!c || !res) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < n; i++) {
        long long fd, len, mtime;
        unsigned long long addr, hdr;

        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i),
                              "LKLKL;each chunk is (fd, address, length, header_address, mtime_ns)", &fd,
                              &addr, &len, &hdr, &mtime))
            goto done;
        if (fd < 0 || fd > INT32_MAX || len < 0 || mtime < 0) {
            PyErr_Format(PyExc_ValueError, "chunk %zd: fd, length and mtime_ns must be >= 0", i);
            goto done;
        }
        if ((len > 0 && addr == 0) || hdr == 0 || hdr % FX_DIO_ALIGN) {
            PyErr_Format(PyExc_ValueError,
                         "chunk %zd: address must not be NULL and header_address must be 4096-aligned", i);
            goto done;
        }
        c[i].fd = (int)fd;
        c[i].src = (const char *)(uintptr_t)addr;
        c[i].length = (uint64_t)len;
        c[i].hdr = (char *)(uintptr_t)hdr;
        c[i].mtime_ns = mtime;
    }
    if (begin_use(self) < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    pool = n > 1 ? chunk_writers(self, &width) : NULL;
    r = fx_chunks_write(c, (size_t)n, direct, pool, width, res);
    Py_END_ALLOW_THREADS
    end_use(self);
    if (chunks_raise(r) < 0)
        goto done;
    out = PyList_New(n);
    for (i = 0; out && i < n; i++) {
        PyObject *v = Py_BuildValue("(LLkl)", (long long)res[i].nbytes, (long long)res[i].hdr,
                                    (unsigned long)res[i].crc, (long)res[i].clock);
        if (!v)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
done:
    Py_DECREF(seq);
    PyMem_Free(c);
    PyMem_Free(res);
    return out;
}

/* ------------------------------------------------------------------ Batch */

typedef struct BatchObject {
    PyObject_HEAD
    EngineObject *engine;
    struct BatchObject *pend_next; /* in the engine's pending list */
    fx_op *ops;
    fx_result *res;
    fx_batch b;
    int efd;
    int status; /* 0 or -errno from the run */
    int started;
    int cancelled; /* cancel() took it off the engine's list before it ran */
    atomic_int stop; /* cancel() of a running read: pieces not yet begun end -ECANCELED */
    /* Set (under mu) by the runner after its last touch of this object:
     * what wait() and dealloc wait for, as a join waits for a thread. */
    int released;
    pthread_mutex_t mu;
    pthread_cond_t released_cv;
    atomic_int finished;
    unsigned gen; /* process generation (fork guard) */
    int is_chunks;   /* submit_chunks: runs chunk files, not ops */
    chunk_args chunks;
    PyObject *notifier; /* a Notifier whose eventfd efd is (not owned), or NULL */
} BatchObject;

/* ---------------------------------------------------------------- Notifier */

/* One eventfd that many batches signal, so an event loop watches one
 * descriptor for all of them: no eventfd made, registered with epoll and
 * removed per batch. Each batch holds a reference, so the descriptor stays
 * open until every runner that may write it is done with its batch. */
typedef struct {
    PyObject_HEAD
    int efd;
} NotifierObject;

static PyObject *Notifier_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {NULL};
    NotifierObject *no;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "", kwlist))
        return NULL;
    if (!(no = (NotifierObject *)type->tp_alloc(type, 0)))
        return NULL;
    no->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (no->efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(no);
        return NULL;
    }
    return (PyObject *)no;
}

static void Notifier_dealloc(NotifierObject *no)
{
    if (no->efd >= 0)
        close(no->efd);
    Py_TYPE(no)->tp_free((PyObject *)no);
}

static PyObject *Notifier_fileno(NotifierObject *no, PyObject *unused)
{
    (void)unused;
    return PyLong_FromLong(no->efd);
}

/* Resets the eventfd; returns how many signals it held (0: none). */
static PyObject *Notifier_drain(NotifierObject *no, PyObject *unused)
{
    uint64_t n = 0;

    (void)unused;
    while (read(no->efd, &n, sizeof(n)) < 0) {
        if (errno == EAGAIN)
            return PyLong_FromLong(0);
        if (errno != EINTR)
            return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(n);
}

/* Whether other awaited batches run or wait as this one starts: then its
 * small payloads go whole (FX_OPEN_WHOLE), unless whole_when_busy is off.
 * Known only under max_running. */
static int engine_busy(EngineObject *e)
{
    int busy;

    if (!e->max_running || !e->whole)
        return 0;
    pthread_mutex_lock(&e->mu);
    busy = e->running > 1 || e->pend_head != NULL;
    pthread_mutex_unlock(&e->mu);
    return busy;
}

static void batch_exec(BatchObject *bo)
{
    int r;

    if (bo->is_chunks) {
        r = chunks_run(bo->engine, &bo->chunks, engine_busy(bo->engine), &bo->stop);
    } else {
        if (!bo->b.write)
            bo->b.stop = &bo->stop;
        /* Here, where the runner holds a use of the engine: in submit() the
         * pool could be freed by a close() finishing meanwhile. */
        crc_helpers(bo->engine, &bo->b);
        r = fx_batch_prepare(&bo->b, bo->engine->split_bytes);
        if (r == 0)
            r = engine_run(bo->engine, &bo->b);
        fx_batch_release(&bo->b);
    }
    bo->status = r;
    atomic_store(&bo->finished, 1);
}

/* Signals the batch's eventfd and lets wait() and dealloc go on: the
 * runner's last touch of it. */
static void batch_done(void *arg)
{
    BatchObject *bo = arg;
    uint64_t one = 1;

    while (write(bo->efd, &one, sizeof(one)) < 0 && errno == EINTR)
        ;
    pthread_mutex_lock(&bo->mu);
    bo->released = 1;
    pthread_cond_broadcast(&bo->released_cv); /* every thread in wait(), not one */
    pthread_mutex_unlock(&bo->mu); /* bo may be freed from here on */
}

/* The oldest batch waiting for a runner, taken off the list; NULL (and one
 * runner fewer counted) when none waits. */
static BatchObject *next_pending(EngineObject *e)
{
    BatchObject *next;

    pthread_mutex_lock(&e->mu);
    next = e->pend_head;
    if (next) {
        e->pend_head = next->pend_next;
        if (!e->pend_head)
            e->pend_tail = NULL;
    } else {
        e->running--;
    }
    pthread_mutex_unlock(&e->mu);
    return next;
}

/* A runner's work: the batch, then each batch that waited for a runner
 * meanwhile, oldest first, every one signalled as it ends; returns the last,
 * which batch_done signals once the runner is listed idle. */
static void *batch_run(void *arg)
{
    BatchObject *bo = arg;
    EngineObject *e = bo->engine;

    for (;;) {
        BatchObject *next;

        batch_exec(bo);
        next = e->max_running ? next_pending(e) : NULL;
        /* The engine is no longer touched for bo (a waiting batch holds a
         * use of its own): close() may proceed even if nobody ever waits. */
        end_use(e);
        if (!next)
            return bo;
        batch_done(bo);
        bo = next;
    }
}

/* Waits until the batch's runner is done with it. */
static void batch_join(BatchObject *bo)
{
    if (FX_FORKED(bo->gen))
        return; /* the runner is the parent's: nothing to wait for here */
    if (!bo->started)
        return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&bo->mu);
    while (!bo->released)
        pthread_cond_wait(&bo->released_cv, &bo->mu);
    pthread_mutex_unlock(&bo->mu);
    Py_END_ALLOW_THREADS
}

/* A Batch object of this engine, nothing allocated or started yet. */
static BatchObject *batch_new(EngineObject *self, int is_chunks)
{
    BatchObject *bo = PyObject_New(BatchObject, &BatchType);

    if (!bo)
        return NULL;
    bo->engine = (EngineObject *)Py_NewRef(self);
    bo->pend_next = NULL;
    bo->ops = NULL;
    bo->res = NULL;
    bo->efd = -1;
    bo->status = 0;
    bo->started = bo->released = bo->cancelled = 0;
    pthread_mutex_init(&bo->mu, NULL);
    pthread_cond_init(&bo->released_cv, NULL);
    bo->gen = fx_fork_gen;
    bo->is_chunks = is_chunks;
    memset(&bo->b, 0, sizeof(bo->b));
    memset(&bo->chunks, 0, sizeof(bo->chunks));
    atomic_init(&bo->finished, 0);
    atomic_init(&bo->stop, 0);
    bo->notifier = NULL;
    return bo;
}

/* Starts a prepared batch on a runner thread (runner.c), or with the
 * engine's max_running batches running lists it for the next runner that
 * finishes; signalled through an eventfd when done. Consumes the reference
 * to bo on failure. */
static PyObject *batch_start(EngineObject *self, BatchObject *bo, PyObject *notify)
{
    if (notify && notify != Py_None) {
        if (!PyObject_TypeCheck(notify, &NotifierType)) {
            PyErr_SetString(PyExc_TypeError, "notify must be an lmcache_fx._fxio.Notifier or None");
            goto fail;
        }
        bo->notifier = Py_NewRef(notify);
        bo->efd = ((NotifierObject *)notify)->efd;
    } else {
        bo->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    }
    if (bo->efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    if (begin_use(self) < 0)
        goto fail;
    bo->started = 1; /* before the runner can see it */
    if (self->max_running) {
        int wait;

        pthread_mutex_lock(&self->mu);
        wait = self->running >= self->max_running;
        if (wait) {
            bo->pend_next = NULL;
            if (self->pend_tail)
                self->pend_tail->pend_next = bo;
            else
                self->pend_head = bo;
            self->pend_tail = bo;
        } else {
            self->running++;
        }
        pthread_mutex_unlock(&self->mu);
        if (wait)
            return (PyObject *)bo; /* a finishing runner takes it up */
    }
    if (fx_runner_start(batch_run, batch_done, bo, self->runner_nice) < 0) {
        bo->started = 0;
        if (self->max_running) {
            pthread_mutex_lock(&self->mu);
            self->running--;
            pthread_mutex_unlock(&self->mu);
        }
        end_use(self);
        PyErr_SetString(PyExc_OSError, "could not start a batch runner thread");
        goto fail;
    }
    return (PyObject *)bo;
fail:
    Py_DECREF(bo);
    return NULL;
}

static PyObject *Engine_submit(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"ops", "write", "crc", "notify", NULL};
    PyObject *ops_obj, *notify = NULL;
    int write = 0, want_crc = 0;
    BatchObject *bo;
    size_t n = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|ppO", kwlist, &ops_obj, &write, &want_crc, &notify))
        return NULL;
    if (!(bo = batch_new(self, 0)))
        return NULL;
    if (parse_ops_results(ops_obj, &bo->ops, &bo->res, &n) < 0)
        goto fail;
    memset(&bo->b, 0, sizeof(bo->b));
    bo->b.ops = bo->ops;
    bo->b.nops = n;
    bo->b.res = bo->res;
    bo->b.write = write;
    bo->b.want_crc = want_crc;
    return batch_start(self, bo, notify);
fail:
    Py_DECREF(bo);
    return NULL;
}

static PyObject *Engine_submit_chunks(EngineObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"chunks", "scratch", "verify", "direct", "lock", "mapped", "stage", "notify", NULL};
    PyObject *chunks, *notify = NULL;
    unsigned long long scratch;
    int verify = 0, direct = 0, lock = 0, mapped = 0, stage = 0;
    BatchObject *bo;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "OK|pppppO", kwlist, &chunks, &scratch, &verify, &direct,
                                     &lock, &mapped, &stage, &notify))
        return NULL;
    if (!(bo = batch_new(self, 1)))
        return NULL;
    if (parse_chunks(chunks, scratch, &bo->chunks) < 0)
        goto fail;
    bo->chunks.verify = verify;
    bo->chunks.direct = direct;
    bo->chunks.lock = lock;
    bo->chunks.mapped = mapped;
    bo->chunks.stage = stage;
    return batch_start(self, bo, notify);
fail:
    Py_DECREF(bo);
    return NULL;
}

static int unlist_pending(EngineObject *e, BatchObject *bo);

static void Batch_dealloc(BatchObject *bo)
{
    /* Still waiting for a runner (max_running): nobody can want its results
     * now; taken off the queue rather than run into memory its owner let go
     * (and waited for here, behind every batch ahead of it). */
    if (bo->started && !FX_FORKED(bo->gen) && bo->engine && unlist_pending(bo->engine, bo)) {
        bo->started = 0;
        end_use(bo->engine);
    }
    batch_join(bo); /* the thread writes into memory this object owns */
    if (bo->efd >= 0 && !bo->notifier)
        close(bo->efd);
    Py_XDECREF(bo->notifier); /* after the join: its eventfd outlives the runner's write */
    if (!FX_FORKED(bo->gen)) { /* a parent's runner may have held them at fork */
        pthread_cond_destroy(&bo->released_cv);
        pthread_mutex_destroy(&bo->mu);
    }
    chunk_args_free(&bo->chunks);
    PyMem_Free(bo->ops);
    PyMem_Free(bo->res);
    Py_XDECREF(bo->engine);
    PyObject_Free(bo);
}

static PyObject *Batch_fileno(BatchObject *bo, PyObject *unused)
{
    (void)unused;
    return PyLong_FromLong(bo->efd);
}

static int batch_forked(BatchObject *bo)
{
    if (!FX_FORKED(bo->gen))
        return 0;
    PyErr_SetString(PyExc_RuntimeError,
                    "lmcache-fx Batch was submitted in another process (fork): it never finishes "
                    "here; create a new Engine in the child");
    return 1;
}

static PyObject *Batch_done(BatchObject *bo, PyObject *unused)
{
    (void)unused;
    if (batch_forked(bo))
        return NULL;
    return PyBool_FromLong(atomic_load(&bo->finished));
}

/* Takes a batch still waiting for a runner off its engine's list: 1 when
 * it was there (it will not run), 0 when it has started or is not listed. */
static int unlist_pending(EngineObject *e, BatchObject *bo)
{
    BatchObject *prev = NULL;
    int found = 0;

    pthread_mutex_lock(&e->mu);
    for (BatchObject *p = e->pend_head; p; prev = p, p = p->pend_next)
        if (p == bo) {
            if (prev)
                prev->pend_next = bo->pend_next;
            else
                e->pend_head = bo->pend_next;
            if (e->pend_tail == bo)
                e->pend_tail = prev;
            found = 1;
            break;
        }
    pthread_mutex_unlock(&e->mu);
    return found;
}

/* A batch cancelled before it ran ends at once, nothing read (its wait()
 * raises OSError ECANCELED): a cancelled request then neither waits its
 * turn nor reads for nobody. A running read stops where it is: what is in
 * flight completes, pieces and chunk files not yet begun end -ECANCELED. */
static PyObject *Batch_cancel(BatchObject *bo, PyObject *unused)
{
    EngineObject *e = bo->engine;

    (void)unused;
    if (batch_forked(bo))
        return NULL;
    if (!unlist_pending(e, bo)) { /* started, finished, or never bounded */
        atomic_store(&bo->stop, 1);
        Py_RETURN_FALSE;
    }
    bo->cancelled = 1;
    atomic_store(&bo->finished, 1);
    end_use(e);
    batch_done(bo);
    Py_RETURN_TRUE;
}

static PyObject *Batch_wait(BatchObject *bo, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {NULL};

    if (!PyArg_ParseTupleAndKeywords(args, kw, "", kwlist))
        return NULL;
    if (batch_forked(bo))
        return NULL;
    batch_join(bo);
    if (bo->cancelled) {
        errno = ECANCELED;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (bo->is_chunks) {
        if (chunks_raise(bo->status) < 0)
            return NULL;
        return chunk_results_to_list(&bo->chunks);
    }
    /* As Engine.read: a batch that could not start (no memory, offsets and
     * lengths out of range) raises, not a 0 for each op it never read. */
    if (bo->status == -EOWNERDEAD) {
        PyErr_SetString(PyExc_RuntimeError, FORK_MSG("Engine"));
        return NULL;
    }
    if (bo->status == -ENOMEM || bo->status == -EINVAL) {
        errno = -bo->status;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return results_to_list(bo->res, bo->b.nops, bo->b.want_crc);
}

/* ------------------------------------------------------------- HostBuffer */

typedef struct {
    PyObject_HEAD
    char *addr;
    size_t size;    /* as asked */
    size_t mapped;  /* rounded */
    int huge;
    unsigned gen;   /* process generation: not mapped in a forked child */
} HostBufferObject;

static PyObject *HostBuffer_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"size", "hugepages", NULL};
    long long size;
    int hugepages = -1; /* -1: when size >= 2 MiB */
    HostBufferObject *hb;
    fx_mem mem;
    int r;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "L|p", kwlist, &size, &hugepages))
        return NULL;
    if (size <= 0) {
        PyErr_Format(PyExc_ValueError, "size must be > 0, not %lld", size);
        return NULL;
    }
    if (hugepages < 0)
        hugepages = (size_t)size >= FX_HUGE_2M;
    /* I/O memory of this process (MADV_DONTFORK: a fork neither copies it
     * nor shares pages the kernel may still be writing). */
    if ((r = fx_mem_alloc(&mem, (size_t)size, hugepages, -1, 0)) < 0) {
        errno = -r;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    hb = (HostBufferObject *)type->tp_alloc(type, 0);
    if (!hb) {
        fx_mem_free(&mem);
        return NULL;
    }
    hb->addr = mem.addr;
    hb->size = (size_t)size;
    hb->mapped = mem.mapped;
    hb->huge = hugepages;
    hb->gen = fx_fork_gen;
    return (PyObject *)hb;
}

static void HostBuffer_dealloc(HostBufferObject *hb)
{
    /* In a forked child the range is not mapped (MADV_DONTFORK) and may hold
     * something else by now. */
    if (hb->addr && !FX_FORKED(hb->gen)) {
        fx_mem m = {.addr = (char *)hb->addr, .mapped = hb->mapped};
        /* Unmapping a touched GiB of 4 KiB pages takes tens of ms: not with
         * every other Python thread waiting (as CPython's FileIO closes). */
        Py_BEGIN_ALLOW_THREADS
        fx_mem_free(&m);
        Py_END_ALLOW_THREADS
    }
    Py_TYPE(hb)->tp_free((PyObject *)hb);
}

static int hostbuffer_forked(HostBufferObject *hb)
{
    if (!FX_FORKED(hb->gen))
        return 0;
    PyErr_SetString(PyExc_RuntimeError,
                    "lmcache-fx HostBuffer was created in another process (fork): its memory is "
                    "not mapped in the child; create a new HostBuffer in the child");
    return 1;
}

static int HostBuffer_getbuffer(HostBufferObject *hb, Py_buffer *view, int flags)
{
    if (hostbuffer_forked(hb))
        return -1;
    return PyBuffer_FillInfo(view, (PyObject *)hb, hb->addr, (Py_ssize_t)hb->size, 0, flags);
}

static PyObject *HostBuffer_address(HostBufferObject *hb, void *c)
{
    (void)c;
    if (hostbuffer_forked(hb))
        return NULL;
    return PyLong_FromUnsignedLongLong((uintptr_t)hb->addr);
}

static Py_ssize_t HostBuffer_len(HostBufferObject *hb) { return (Py_ssize_t)hb->size; }

/* -------------------------------------------------------- module functions */

/* fx_crc32c over len bytes at buf, with the implementation named impl
 * (NULL: the one in use), the GIL released. 0, or -1 with ValueError for
 * an implementation this CPU does not run. */
static int crc32c_call(const char *impl, uint32_t value, const void *buf, size_t len, uint32_t *crc)
{
    int r = 0;

    Py_BEGIN_ALLOW_THREADS
    if (impl)
        r = fx_crc32c_with(impl, value, buf, len, crc);
    else
        *crc = fx_crc32c(value, buf, len);
    Py_END_ALLOW_THREADS
    if (r < 0)
        PyErr_Format(PyExc_ValueError, "CRC32C implementation '%s' is not one this CPU runs "
                                       "(crc32c_impls() lists them)", impl);
    return r;
}

static PyObject *mod_crc32c(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"data", "value", "impl", NULL};
    Py_buffer view;
    unsigned int value = 0;
    const char *impl = NULL;
    uint32_t crc;
    int r;

    (void)m;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*|Iz", kwlist, &view, &value, &impl))
        return NULL;
    if (view.len > 65536 || impl) {
        r = crc32c_call(impl, value, view.buf, (size_t)view.len, &crc);
    } else {
        crc = fx_crc32c(value, view.buf, (size_t)view.len);
        r = 0;
    }
    PyBuffer_Release(&view);
    return r < 0 ? NULL : PyLong_FromUnsignedLong(crc);
}

static PyObject *mod_crc32c_at(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"address", "length", "value", "impl", NULL};
    unsigned long long addr, len;
    unsigned int value = 0;
    const char *impl = NULL;
    uint32_t crc;

    (void)m;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KK|Iz", kwlist, &addr, &len, &value, &impl))
        return NULL;
    if (crc32c_call(impl, value, (const void *)(uintptr_t)addr, (size_t)len, &crc) < 0)
        return NULL;
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *mod_crc32c_copy(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"dst", "src", "length", "value", NULL};
    unsigned long long dst, src, len;
    unsigned int value = 0;
    uint32_t crc;

    (void)m;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKK|I", kwlist, &dst, &src, &len, &value))
        return NULL;
    if (len && (!dst || !src)) {
        PyErr_SetString(PyExc_ValueError, "dst and src must not be NULL");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    crc = fx_crc32c_copy(value, (void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)len);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *mod_crc32c_impls(PyObject *m, PyObject *unused)
{
    const char *names[16];
    size_t n = fx_crc32c_impls(names, 16);
    PyObject *out = PyList_New((Py_ssize_t)n);

    (void)m;
    (void)unused;
    for (size_t i = 0; out && i < n; i++) {
        PyObject *s = PyUnicode_FromString(names[i]);

        if (!s) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, s);
    }
    return out;
}

static PyObject *mod_last_read_chunks_ns(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    return Py_BuildValue("KK", (unsigned long long)last_engine_ns, (unsigned long long)last_gil_ns);
}

static PyObject *mod_map_stats(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    return Py_BuildValue("(kk)", (unsigned long)fx_map_pieces, (unsigned long)fx_map_faults);
}

/* The core's counters, for tests and probes: one function each. */
#define COUNTER_FN(fn, value)                                   \
    static PyObject *fn(PyObject *m, PyObject *unused)          \
    {                                                           \
        (void)m;                                                \
        (void)unused;                                           \
        return PyLong_FromUnsignedLong(value);                  \
    }

/* _piece_order(ops, split): the (op, offset) of each piece of a read of ops
 * in the order the io_uring engine queues them (tests; split 0: 1 MiB). */
static PyObject *mod_piece_order(PyObject *m, PyObject *args)
{
    PyObject *ops_obj, *out = NULL;
    unsigned long long split;
    fx_batch b = {0};
    fx_op *ops;
    fx_result *res;
    size_t n = 0, *order;
    unsigned ndevs;
    int r;

    (void)m;
    if (!PyArg_ParseTuple(args, "OK", &ops_obj, &split))
        return NULL;
    if (check_split(split) < 0 || parse_ops_results(ops_obj, &ops, &res, &n) < 0)
        return NULL;
    b.ops = ops;
    b.nops = n;
    b.res = res;
    r = fx_batch_prepare(&b, split ? split : 1u << 20); /* 0: split_bytes' default */
    if (r < 0) {
        errno = -r;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    order = fx_piece_order(&b, &ndevs);
    out = PyList_New((Py_ssize_t)b.npieces);
    for (size_t i = 0; out && i < b.npieces; i++) {
        const fx_piece *p = &b.pieces[order ? order[i] : i];
        PyObject *t = Py_BuildValue("(IK)", p->op, (unsigned long long)p->offset);

        if (!t) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, t);
    }
    free(order);
done:
    fx_batch_release(&b);
    PyMem_Free(ops);
    PyMem_Free(res);
    return out;
}

/* _set_piece_order(ops): True keeps every read's pieces in op order, False
 * interleaves them over devices (the default); returns the previous setting
 * (probes and tests: the bench's fx-op-order reader). */
static PyObject *mod_set_piece_order(PyObject *m, PyObject *arg)
{
    int ops = PyObject_IsTrue(arg);

    (void)m;
    if (ops < 0)
        return NULL;
    return PyBool_FromLong(atomic_exchange(&fx_piece_order_ops, ops));
}

static PyObject *mod_set_one_lane(PyObject *m, PyObject *arg)
{
    int one = PyObject_IsTrue(arg);

    (void)m;
    if (one < 0)
        return NULL;
    return PyBool_FromLong(atomic_exchange(&fx_chunk_one_lane, one));
}

COUNTER_FN(mod_crc_spread_runs, fx_crc_spread_runs)
COUNTER_FN(mod_direct_staged_pieces, fx_direct_staged_pieces)
COUNTER_FN(mod_stage_buffers, fx_stage_buffers())
COUNTER_FN(mod_staged_pieces, fx_staged_pieces)
COUNTER_FN(mod_uring_peak_inflight, atomic_exchange(&fx_uring_peak_inflight, 0))
COUNTER_FN(mod_uring_sync_pieces, fx_uring_sync_pieces)
COUNTER_FN(mod_whole_payloads, fx_whole_payloads)
COUNTER_FN(mod_uring_last_end, fx_uring_last_end)
COUNTER_FN(mod_runners_idle, fx_runners_idle())
COUNTER_FN(mod_runners_started, fx_runners_started())
COUNTER_FN(mod_helper_waves, fx_helper_waves)

/* A call without arguments that may block (faults pages in, makes rings),
 * made with the GIL released; its result converted by to_py. */
#define RELEASED_CALL_FN(fn, ctype, call, to_py)                \
    static PyObject *fn(PyObject *m, PyObject *unused)          \
    {                                                           \
        ctype v;                                                \
                                                                \
        (void)m;                                                \
        (void)unused;                                           \
        Py_BEGIN_ALLOW_THREADS                                  \
        v = call;                                               \
        Py_END_ALLOW_THREADS                                    \
        return to_py(v);                                        \
    }

/* stage_prepare(devices=1): faults the staging pages in (and may compact
 * memory first), so the GIL is released. */
static PyObject *mod_stage_prepare(PyObject *m, PyObject *args)
{
    unsigned devices = 1;
    unsigned long v;

    (void)m;
    if (!PyArg_ParseTuple(args, "|I", &devices))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    v = fx_stage_prepare(devices ? devices : 1);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(v);
}
RELEASED_CALL_FN(mod_io_uring_shares_buffers, long, fx_uring_shares_registration(), PyBool_FromLong)

static PyObject *mod_io_uring_status(PyObject *m, PyObject *unused)
{
    char why[256] = "";
    fx_uring *u;

    (void)m;
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    u = fx_uring_create(4, why, sizeof(why));
    Py_END_ALLOW_THREADS
    if (u) {
        fx_uring_destroy(u);
        return Py_BuildValue("(Os)", Py_True, "io_uring works");
    }
    return Py_BuildValue("(Os)", Py_False, why);
}

/* Asks for huge pages on the 2 MiB-aligned interior of a region that is
 * already mapped (e.g. LMCache's pool) and collapses it now; bigger pages
 * give the block layer bigger requests. Returns bytes advised or -errno. */
static PyObject *mod_advise_hugepages(PyObject *m, PyObject *args)
{
    unsigned long long addr, len;
    uintptr_t a, e;
    int r = 0;

    (void)m;
    if (!PyArg_ParseTuple(args, "KK", &addr, &len))
        return NULL;
    a = ((uintptr_t)addr + FX_HUGE_2M - 1) & ~(uintptr_t)(FX_HUGE_2M - 1);
    e = ((uintptr_t)addr + len) & ~(uintptr_t)(FX_HUGE_2M - 1);
    if (e <= a)
        return PyLong_FromLong(0);
    Py_BEGIN_ALLOW_THREADS
    if (madvise((void *)a, e - a, MADV_HUGEPAGE) < 0)
        r = -errno;
    else
        (void)madvise((void *)a, e - a, MADV_COLLAPSE); /* best effort, 6.1+ */
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(r < 0 ? r : (long long)(e - a));
}

/* Fault points fired since the last Engine() armed LMCACHE_FX_FAULT. */
static PyObject *mod_fault_counts(PyObject *m, PyObject *unused)
{
    PyObject *d = PyDict_New();

    (void)m;
    (void)unused;
    for (int k = 0; d && k < FX_FAULT_NKINDS; k++) {
        PyObject *v = PyLong_FromLong(fx_fault_fired(k));
        if (!v || PyDict_SetItemString(d, fx_fault_name(k), v) < 0) {
            Py_XDECREF(v);
            Py_CLEAR(d);
            break;
        }
        Py_DECREF(v);
    }
    return d;
}

/* ----------------------------------------------------------------- tables */

static PyObject *Engine_get_kind(EngineObject *e, void *c)
{
    (void)c;
    return PyUnicode_FromString(e->kind == KIND_URING ? "io_uring" : "threads");
}
static PyObject *Engine_get_qd(EngineObject *e, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLong(e->queue_depth);
}
static PyObject *Engine_get_split(EngineObject *e, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(e->split_bytes);
}
static PyObject *Engine_get_threads(EngineObject *e, void *c)
{
    (void)c;
    return PyLong_FromLong(e->kind == KIND_THREADS ? e->nthreads : 0);
}
static PyObject *Engine_get_reason(EngineObject *e, void *c)
{
    (void)c;
    return Py_NewRef(e->fallback_reason ? e->fallback_reason : Py_None);
}
static PyObject *Engine_get_registered(EngineObject *e, void *c)
{
    int r;

    (void)c;
    if (FX_FORKED(e->gen))
        return Py_NewRef(Py_False);
    /* Under mu and only while open: a close() on another thread frees the
     * ring once its last user is gone, without the GIL. */
    pthread_mutex_lock(&e->mu);
    r = !e->closed && e->kind == KIND_URING && e->uring && fx_uring_registered(e->uring);
    pthread_mutex_unlock(&e->mu);
    return PyBool_FromLong(r);
}
static PyObject *Engine_get_closed(EngineObject *e, void *c)
{
    (void)c;
    return PyBool_FromLong(e->closed);
}

static PyObject *Engine_get_max_running(EngineObject *e, void *c)
{
    (void)c;
    return PyLong_FromLong(e->max_running);
}

/* Batches running and waiting now (under the bound; 0 and 0 without one).
 * The list is counted when asked (a metrics scrape), not kept counted. */
static PyObject *Engine_get_awaited(EngineObject *e, void *c)
{
    int running, waiting = 0;

    (void)c;
    if (FX_FORKED(e->gen))
        return Py_BuildValue("(ii)", 0, 0); /* the parent's runners, not this process's */
    pthread_mutex_lock(&e->mu);
    running = e->running;
    for (const BatchObject *p = e->pend_head; p; p = p->pend_next)
        waiting++;
    pthread_mutex_unlock(&e->mu);
    return Py_BuildValue("(ii)", running, waiting);
}

static PyObject *Engine_get_whole(EngineObject *e, void *c)
{
    (void)c;
    return PyBool_FromLong(e->whole);
}

static PyObject *Engine_get_runner_nice(EngineObject *e, void *c)
{
    (void)c;
    return PyLong_FromLong(e->runner_nice);
}

static PyGetSetDef Engine_getset[] = {
    {"kind", (getter)Engine_get_kind, NULL, "'io_uring' or 'threads'", NULL},
    {"queue_depth", (getter)Engine_get_qd, NULL, "pieces in flight per batch", NULL},
    {"split_bytes", (getter)Engine_get_split, NULL, "largest piece", NULL},
    {"threads", (getter)Engine_get_threads, NULL, "I/O threads (thread engine)", NULL},
    {"runner_nice", (getter)Engine_get_runner_nice, NULL,
     "priority steps a submitted batch's runner thread runs below the submitter", NULL},
    {"max_running", (getter)Engine_get_max_running, NULL,
     "submitted batches run at once; more wait and run in arrival order (0: no bound)", NULL},
    {"whole_when_busy", (getter)Engine_get_whole, NULL,
     "a submitted batch started beside others reads O_DIRECT payloads of at most " FX_STR(FX_WHOLE_MAX_MIB)
     " MiB as one request",
     NULL},
    {"batches_now", (getter)Engine_get_awaited, NULL,
     "(running, waiting) submitted batches now, counted where max_running bounds them", NULL},
    {"fallback_reason", (getter)Engine_get_reason, NULL, "why io_uring is not used, or None", NULL},
    {"registered", (getter)Engine_get_registered, NULL, "a fixed buffer is registered", NULL},
    {"closed", (getter)Engine_get_closed, NULL, "close() was called", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Engine_methods[] = {
    {"read", (PyCFunction)(void (*)(void))Engine_read, METH_VARARGS | METH_KEYWORDS,
     "read(ops, crc=False, split=0, stage=False) -> list: bytes read or -errno per op (with CRC32C if crc); "
     "split: largest piece for this call (0: the engine's split_bytes); stage: checked O_DIRECT pieces go "
     "through slots of a cache-sized staging pool (io_uring engine)"},
    {"write", (PyCFunction)(void (*)(void))Engine_write, METH_VARARGS | METH_KEYWORDS,
     "write(ops, crc=False, split=0) -> list: bytes written or -errno per op; "
     "split: largest piece for this call (0: the engine's split_bytes)"},
    {"submit", (PyCFunction)(void (*)(void))Engine_submit, METH_VARARGS | METH_KEYWORDS,
     "submit(ops, write=False, crc=False) -> Batch running in the background"},
    {"read_chunks", (PyCFunction)(void (*)(void))Engine_read_chunks, METH_VARARGS | METH_KEYWORDS,
     "read_chunks(chunks, scratch, verify=False, direct=False, lock=False, mapped=False, stage=False) -> list of "
     "(status, nbytes, st_dev, st_ino, st_size) per chunk (dir_fd, name, address, length[, expect]); "
     "mapped: payloads of 2 MiB files or more on a memory filesystem are copied (and summed) from a "
     "mapping of the file; stage: verified O_DIRECT payloads go through slots of a cache-sized staging pool"},
    {"write_chunks", (PyCFunction)(void (*)(void))Engine_write_chunks, METH_VARARGS | METH_KEYWORDS,
     "write_chunks(chunks, direct=False) -> list of (payload bytes or -errno, header bytes or -errno, "
     "payload CRC32C, mtime set: 1, 0 or -errno); chunks are (fd, address, length, header_address, "
     "mtime_ns or 0)"},
    {"submit_chunks", (PyCFunction)(void (*)(void))Engine_submit_chunks,
     METH_VARARGS | METH_KEYWORDS,
     "submit_chunks(chunks, scratch, verify=False, direct=False, lock=False, mapped=False, stage=False) -> Batch whose "
     "wait() returns "
     "read_chunks' results"},
    {"register_buffer", (PyCFunction)Engine_register_buffer, METH_VARARGS,
     "register_buffer(address, length) -> 0 or -errno; (0, 0) unregisters"},
    {"close", (PyCFunction)Engine_close, METH_NOARGS, "wait for running batches, free the engine"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lmcache_fx._fxio.Engine",
    .tp_basicsize = sizeof(EngineObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Engine(io_engine='auto', queue_depth=32, split_bytes=1 MiB, threads=0, staged=True)",
    .tp_new = Engine_new,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
    .tp_getset = Engine_getset,
};

static PyMethodDef Batch_methods[] = {
    {"fileno", (PyCFunction)Batch_fileno, METH_NOARGS, "eventfd readable once the batch is done"},
    {"done", (PyCFunction)Batch_done, METH_NOARGS, "whether the batch has finished"},
    {"wait", (PyCFunction)(void (*)(void))Batch_wait, METH_VARARGS | METH_KEYWORDS,
     "wait() -> results, blocking without the GIL"},
    {"cancel", (PyCFunction)Batch_cancel, METH_NOARGS,
     "cancel() -> True when the batch was still waiting for a runner: it ends at once, unread. False: a "
     "running read stops where it is (what is in flight completes; the rest ends ECANCELED), or it had ended"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lmcache_fx._fxio.Batch",
    .tp_basicsize = sizeof(BatchObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A batch running on a C thread; see Engine.submit",
    .tp_dealloc = (destructor)Batch_dealloc,
    .tp_methods = Batch_methods,
};

static PyMethodDef Notifier_methods[] = {
    {"fileno", (PyCFunction)Notifier_fileno, METH_NOARGS, "the eventfd the batches given it signal"},
    {"drain", (PyCFunction)Notifier_drain, METH_NOARGS, "drain() -> signals since the last drain (0: none)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject NotifierType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lmcache_fx._fxio.Notifier",
    .tp_basicsize = sizeof(NotifierObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Notifier(): one eventfd signalled by every batch submitted with notify=it",
    .tp_new = Notifier_new,
    .tp_dealloc = (destructor)Notifier_dealloc,
    .tp_methods = Notifier_methods,
};

static PyBufferProcs HostBuffer_as_buffer = {(getbufferproc)HostBuffer_getbuffer, NULL};
static PySequenceMethods HostBuffer_as_seq = {.sq_length = (lenfunc)HostBuffer_len};
static PyGetSetDef HostBuffer_getset[] = {
    {"address", (getter)HostBuffer_address, NULL, "start address", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HostBufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lmcache_fx._fxio.HostBuffer",
    .tp_basicsize = sizeof(HostBufferObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "HostBuffer(size, hugepages=size >= 2 MiB): aligned anonymous memory",
    .tp_new = HostBuffer_new,
    .tp_dealloc = (destructor)HostBuffer_dealloc,
    .tp_as_buffer = &HostBuffer_as_buffer,
    .tp_as_sequence = &HostBuffer_as_seq,
    .tp_getset = HostBuffer_getset,
};

static PyMethodDef module_methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))mod_crc32c, METH_VARARGS | METH_KEYWORDS,
     "crc32c(data, value=0, impl=None) -> int"},
    {"utime_beneath", (PyCFunction)mod_utime_beneath, METH_O,
     "utime_beneath(items) -> failures: atime and mtime of each (dir_fd, name, mtime_ns) set to mtime_ns, a "
     "symlink in the last component not followed, without the GIL"},
    {"rename_noreplace", mod_rename_noreplace, METH_VARARGS,
     "rename_noreplace(dir_fd, src, dst): src renamed to dst within dir_fd where dst does not exist "
     "(RENAME_NOREPLACE), without the GIL; OSError EEXIST where it does, EINVAL/ENOSYS where unsupported"},
    {"stat_beneath", (PyCFunction)(void (*)(void))mod_stat_beneath, METH_VARARGS | METH_KEYWORDS,
     "stat_beneath(items, stop_at_missing=False) -> [None or (st_mode, st_size, st_mtime_ns, st_dev, "
     "st_ino)]: lstat of each (dir_fd, name), no symlink followed on the way, without the GIL"},
    {"crc32c_impls", (PyCFunction)mod_crc32c_impls, METH_NOARGS,
     "crc32c_impls() -> list of the CRC32C implementations this CPU runs, the one in use first"},
    {"_uring_peak_inflight", (PyCFunction)mod_uring_peak_inflight, METH_NOARGS,
     "_uring_peak_inflight() -> int: most pieces one io_uring run had out at once since the last call (tests)"},
    {"uring_sync_pieces", (PyCFunction)mod_uring_sync_pieces, METH_NOARGS,
     "uring_sync_pieces() -> int: io_uring pieces the kernel cancelled for want of an io-wq worker "
     "(a pids limit), then run on the reaping thread"},
    {"_uring_last_end", (PyCFunction)mod_uring_last_end, METH_NOARGS,
     "_uring_last_end() -> int: the engine's slots returned so far when this thread's last io_uring run "
     "returned its last (tests)"},
    {"crc32c_copy", (PyCFunction)(void (*)(void))mod_crc32c_copy, METH_VARARGS | METH_KEYWORDS,
     "crc32c_copy(dst, src, length, value=0) -> int: copies length bytes (addresses) and returns their "
     "CRC32C, in one pass where CRC32C_COPY_ONE_PASS"},
    {"map_stats", (PyCFunction)mod_map_stats, METH_NOARGS,
     "map_stats() -> (pieces copied from a file mapping, copies whose source faulted and were read instead)"},
    {"_runners_idle", (PyCFunction)mod_runners_idle, METH_NOARGS,
     "_runners_idle() -> int: batch runner threads waiting for the next submit (tests)"},
    {"_runners_started", (PyCFunction)mod_runners_started, METH_NOARGS,
     "_runners_started() -> int: batch runner threads started in this process so far (tests)"},
    {"_helper_waves", (PyCFunction)mod_helper_waves, METH_NOARGS,
     "_helper_waves() -> int: waves of chunk files read_chunks read on its second lane so far (tests)"},
    {"whole_payloads", (PyCFunction)mod_whole_payloads, METH_NOARGS,
     "whole_payloads() -> int: payloads an awaited read among others read as one request (FX_OPEN_WHOLE)"},
    {"direct_staged_pieces", (PyCFunction)mod_direct_staged_pieces, METH_NOARGS,
     "direct_staged_pieces() -> int: O_DIRECT pieces the io_uring engine read through a staging slot (stage=True)"},
    {"io_uring_shares_buffers", (PyCFunction)mod_io_uring_shares_buffers, METH_NOARGS,
     "io_uring_shares_buffers() -> bool: whether the kernel clones one ring's fixed buffers into another "
     "(Linux 6.12+); without it a table over FIXED_PER_RING_MAX is not registered"},
    {"stage_prepare", (PyCFunction)mod_stage_prepare, METH_VARARGS,
     "stage_prepare(devices=1) -> int: makes the io_uring engine's staging buffers now, two of 8 MiB for each device "
     "a store stripes over, up to eight devices (a store that stages its reads calls it when it opens, so no read waits for "
     "their pages); returns how many this process has"},
    {"_stage_buffers", (PyCFunction)mod_stage_buffers, METH_NOARGS,
     "_stage_buffers() -> int: 8 MiB buffers of staging slots the io_uring engine has made in this process (tests)"},
    {"staged_pieces", (PyCFunction)mod_staged_pieces, METH_NOARGS,
     "staged_pieces() -> int: pieces read from memory through a staging buffer and copied on with their CRC32C"},
    {"last_read_chunks_ns", (PyCFunction)mod_last_read_chunks_ns, METH_NOARGS,
     "last_read_chunks_ns() -> (engine_ns, gil_ns): this thread's last read_chunks call, its time in the engine "
     "and its wait for the GIL after it"},
    {"_set_one_lane", (PyCFunction)mod_set_one_lane, METH_O,
     "_set_one_lane(one: bool) -> bool: True reads every read_chunks call's waves one after another on the calling "
     "thread (probes, tests); returns the previous setting"},
    {"_set_piece_order", (PyCFunction)mod_set_piece_order, METH_O,
     "_set_piece_order(ops: bool) -> bool: True keeps every read's pieces in op order (probes, tests); returns the "
     "previous setting"},
    {"_piece_order", (PyCFunction)mod_piece_order, METH_VARARGS,
     "_piece_order(ops, split) -> [(op, offset)]: the pieces of a read of ops in the order the io_uring engine "
     "queues them (tests)"},
    {"crc_spread_runs", (PyCFunction)mod_crc_spread_runs, METH_NOARGS,
     "crc_spread_runs() -> int: io_uring batches whose landed pieces were checksummed on several threads"},
    {"crc32c_at", (PyCFunction)(void (*)(void))mod_crc32c_at, METH_VARARGS | METH_KEYWORDS,
     "crc32c_at(address, length, value=0, impl=None) -> int"},
    {"io_uring_status", (PyCFunction)mod_io_uring_status, METH_NOARGS,
     "io_uring_status() -> (usable, reason)"},
    {"advise_hugepages", (PyCFunction)mod_advise_hugepages, METH_VARARGS,
     "advise_hugepages(address, length) -> bytes advised or -errno"},
    {"_fault_counts", (PyCFunction)mod_fault_counts, METH_NOARGS,
     "_fault_counts() -> {fault point: times fired} (tests; see LMCACHE_FX_FAULT)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fxio_module = {
    PyModuleDef_HEAD_INIT, "_fxio", "lmcache-fx C core: io_uring and thread I/O engines", -1,
    module_methods,
};

/* CHUNK_OK, CHUNK_SHORT, ... and CHUNK_STATUS_NAMES (code -> name). */
static int add_chunk_constants(PyObject *m)
{
    static const char *const consts[FX_CHUNK_NCODES] = {
        "CHUNK_OK",      "CHUNK_SHORT",      "CHUNK_BAD_MAGIC", "CHUNK_BAD_CRC",
        "CHUNK_VERSION", "CHUNK_BAD_HEADER", "CHUNK_LENGTH",    "CHUNK_META",
        "CHUNK_PAYLOAD_CRC",
    };
    PyObject *names = PyTuple_New(FX_CHUNK_NCODES);

    if (!names)
        return -1;
    for (int k = 0; k < FX_CHUNK_NCODES; k++) {
        PyObject *v = PyUnicode_FromString(fx_chunk_status_name(k));
        if (!v || PyModule_AddIntConstant(m, consts[k], k) < 0) {
            Py_XDECREF(v);
            Py_DECREF(names);
            return -1;
        }
        PyTuple_SET_ITEM(names, k, v);
    }
    if (PyModule_AddObjectRef(m, "CHUNK_STATUS_NAMES", names) < 0) {
        Py_DECREF(names);
        return -1;
    }
    Py_DECREF(names);
    return PyModule_AddIntConstant(m, "CHUNK_HEADER_SIZE", FX_HDR_SIZE);
}

/* The module with the core's types, functions and constants (csrc/init.c
 * adds the GPU pipeline's), or NULL with an exception set. */
PyObject *fx_core_module_create(void)
{
    const char *order = getenv("LMCACHE_FX_PIECE_ORDER"); /* at import, before any engine thread */
    PyObject *m;

    if (order && strcmp(order, "ops") == 0)
        atomic_store(&fx_piece_order_ops, 1);
    if (fx_fork_guard_init() < 0) {
        PyErr_SetString(PyExc_ImportError, "lmcache-fx: pthread_atfork failed");
        return NULL;
    }
    if (PyType_Ready(&EngineType) < 0 || PyType_Ready(&BatchType) < 0 ||
        PyType_Ready(&NotifierType) < 0 || PyType_Ready(&HostBufferType) < 0)
        return NULL;
    m = PyModule_Create(&fxio_module);
    if (!m)
        return NULL;
    if (PyModule_AddObjectRef(m, "Engine", (PyObject *)&EngineType) < 0 ||
        PyModule_AddObjectRef(m, "Batch", (PyObject *)&BatchType) < 0 ||
        PyModule_AddObjectRef(m, "Notifier", (PyObject *)&NotifierType) < 0 ||
        PyModule_AddObjectRef(m, "HostBuffer", (PyObject *)&HostBufferType) < 0 ||
        PyModule_AddIntConstant(m, "DIO_ALIGN", FX_DIO_ALIGN) < 0 ||
        PyModule_AddIntConstant(m, "HAVE_LIBURING", fx_uring_available()) < 0 ||
        PyModule_AddStringConstant(m, "CRC32C_IMPL", fx_crc32c_impl()) < 0 ||
        PyModule_AddIntConstant(m, "CRC32C_COPY_ONE_PASS", fx_crc32c_copy_one_pass()) < 0 ||
        PyModule_AddIntConstant(m, "FIXED_PER_RING_MAX", (long)FX_FIXED_PER_RING_MAX) < 0 ||
        PyModule_AddIntConstant(m, "WHOLE_MAX", (long)FX_WHOLE_MAX) < 0 ||
        add_chunk_constants(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
