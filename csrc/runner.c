/* Runners: the threads Engine.submit runs batches on, kept between batches.
 *
 * A batch goes to an idle runner, or to a new thread when none is idle, so
 * batches still run as concurrently as with a thread each (an engine's
 * max_running bounds that in module.c, above this); what goes is the
 * thread's creation per batch, paid by the submitter (LMCache's event loop,
 * for awaited reads): pthread_create costs ~24 µs of the caller's CPU on the
 * 2-core VMs here, waking a sleeping runner ~10, handing work to one not yet
 * asleep next to nothing. A runner idle for RUNNER_IDLE_S exits; at most
 * RUNNER_IDLE_MAX wait at a time.
 *
 * A runner runs some priority steps (runner_nice) below the thread that
 * started it: for awaited reads that is LMCache's event loop, which at equal
 * priority on a host short of CPU waits behind the runners' copies and
 * checksums with finished reads to hand back (docs/benchmarks.md, "Runner
 * priority"). Only idle runners at the nice value a batch asks for are
 * reused, since an unprivileged thread cannot raise its priority again. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "fxio.h"

#define RUNNER_IDLE_S 10
#define RUNNER_IDLE_MAX 64

typedef struct fx_runner {
    pthread_cond_t cv; /* CLOCK_MONOTONIC */
    fx_runner_work fn; /* the work handed over, NULL while idle */
    fx_runner_fn done; /* its last step, after the runner is listed idle */
    void *arg;
    int nice;               /* its nice value: its starter's plus the steps asked */
    struct fx_runner *next; /* in the idle list */
} fx_runner;

static pthread_mutex_t runners_mu = PTHREAD_MUTEX_INITIALIZER;
static fx_runner *idle;
static unsigned nidle;
static unsigned long nstarted; /* threads started, ever: for tests */
static pthread_once_t runners_once = PTHREAD_ONCE_INIT;

/* A forked child has none of the parent's threads: the idle list names
 * runners that do not exist there (their memory is left, not freed: a
 * parent thread may have been mid-way through it). */
static void runners_fork_child(void)
{
    pthread_mutex_init(&runners_mu, NULL);
    idle = NULL;
    nidle = 0;
    nstarted = 0; /* counts this process's threads */
}

static void runners_init(void) { pthread_atfork(NULL, NULL, runners_fork_child); }

/* The calling thread's nice value. On Linux nice is per thread, and
 * PRIO_PROCESS with who 0 names the calling thread itself (the kernel looks
 * at `current`), so no gettid syscall is needed: this runs once per
 * submitted batch. */
static int thread_nice(void)
{
    int now;

    errno = 0;
    now = getpriority(PRIO_PROCESS, 0);
    return now == -1 && errno ? 0 : now;
}

/* Sets the calling runner's nice to `nice`, at or below the priority it
 * inherited from its starter. Linux lets any thread lower its own priority,
 * so a failure (a seccomp filter refusing setpriority) only leaves it at the
 * starter's, as before. */
static void set_nice(int nice)
{
    pthread_setname_np(pthread_self(), "fx-runner");
    if (nice != thread_nice())
        (void)setpriority(PRIO_PROCESS, 0, nice);
}

static void unlink_idle(fx_runner *r)
{
    for (fx_runner **p = &idle; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            nidle--;
            return;
        }
}

/* Lists the runner as idle (runners_mu held): -1 when enough are. */
static int list_idle(fx_runner *r, struct timespec *until)
{
    r->fn = NULL;
    if (nidle >= RUNNER_IDLE_MAX)
        return -1;
    r->next = idle;
    idle = r;
    nidle++;
    clock_gettime(CLOCK_MONOTONIC, until);
    until->tv_sec += RUNNER_IDLE_S;
    return 0;
}

/* Waits for the next work (runners_mu held): 0 when it came, -1 when none
 * came before `until` (the runner is then unlisted and should exit). */
static int await_work(fx_runner *r, const struct timespec *until)
{
    while (!r->fn)
        if (pthread_cond_timedwait(&r->cv, &runners_mu, until) == ETIMEDOUT && !r->fn) {
            unlink_idle(r);
            return -1;
        }
    return 0;
}

/* Runs work, and lists itself idle before the work's `done` step: the
 * caller that `done` wakes may submit again at once and should find this
 * runner, awake, rather than start another thread. */
static void *runner_main(void *arg)
{
    fx_runner *r = arg;
    struct timespec until;
    int listed;

    set_nice(r->nice);
    for (;;) {
        fx_runner_fn done = r->done;
        void *work = r->fn(r->arg);

        pthread_mutex_lock(&runners_mu);
        listed = list_idle(r, &until) == 0;
        pthread_mutex_unlock(&runners_mu);
        done(work); /* may free `work` */
        if (!listed)
            break;
        pthread_mutex_lock(&runners_mu);
        if (await_work(r, &until) < 0) {
            pthread_mutex_unlock(&runners_mu);
            break;
        }
        pthread_mutex_unlock(&runners_mu);
    }
    pthread_cond_destroy(&r->cv);
    free(r);
    return NULL;
}

static fx_runner *runner_new(fx_runner_work fn, fx_runner_fn done, void *arg, int nice)
{
    fx_runner *r = calloc(1, sizeof(*r));
    pthread_condattr_t ca;
    pthread_attr_t ta;
    pthread_t t;
    int ok;

    if (!r)
        return NULL;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    ok = pthread_cond_init(&r->cv, &ca) == 0;
    pthread_condattr_destroy(&ca);
    if (!ok) {
        free(r);
        return NULL;
    }
    r->fn = fn;
    r->done = done;
    r->arg = arg;
    r->nice = nice;
    pthread_attr_init(&ta);
    pthread_attr_setdetachstate(&ta, PTHREAD_CREATE_DETACHED);
    ok = pthread_create(&t, &ta, runner_main, r) == 0;
    pthread_attr_destroy(&ta);
    if (!ok) {
        pthread_cond_destroy(&r->cv);
        free(r);
        return NULL;
    }
    return r;
}

int fx_runner_start(fx_runner_work fn, fx_runner_fn done, void *arg, int steps)
{
    int nice = thread_nice() + steps;
    fx_runner *r;

    if (nice > 19)
        nice = 19;
    pthread_once(&runners_once, runners_init);
    pthread_mutex_lock(&runners_mu);
    for (r = idle; r && r->nice != nice; r = r->next)
        ;
    if (r) {
        unlink_idle(r);
        r->fn = fn;
        r->done = done;
        r->arg = arg;
        pthread_cond_signal(&r->cv);
    }
    pthread_mutex_unlock(&runners_mu);
    if (r)
        return 0;
    if (!runner_new(fn, done, arg, nice))
        return -EAGAIN;
    __atomic_fetch_add(&nstarted, 1, __ATOMIC_RELAXED);
    return 0;
}

/* Relaxed reads of counts kept under runners_mu: for tests, which read them
 * with no submit in flight. */
unsigned fx_runners_idle(void) { return __atomic_load_n(&nidle, __ATOMIC_RELAXED); }
unsigned long fx_runners_started(void) { return __atomic_load_n(&nstarted, __ATOMIC_RELAXED); }
