/* Copies out of a file mapping, guarded against SIGBUS.
 *
 * On a tmpfs that keeps files in 2 MiB pages, copying a payload out of a
 * mapping of its file and summing it in the same pass (fx_crc32c_copy) is
 * faster than read() followed by a CRC32C of what landed: the kernel's copy
 * and the check's second read become one pass (docs/benchmarks.md, "Mapped
 * reads"). A mapping has one hazard read() has not: a file truncated by
 * another process under the mapping raises SIGBUS on the next load past its
 * new end. A guarded copy turns that into -EFAULT: a process-wide SIGBUS
 * handler jumps back to the copy that faulted when the fault lies in the
 * range this thread is copying from, and hands every other SIGBUS to the
 * handler that was there before (or to the default action). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "fxio.h"

/* This thread's copy in progress: where to jump back to, and the source
 * range a fault must lie in. Set before, cleared after, each copy. */
/* Initial-exec: static TLS, which the handler reads without an allocation
 * even in a thread that never copied. */
#define FX_TLS __thread __attribute__((tls_model("initial-exec")))
static FX_TLS sigjmp_buf *guard_env;
static FX_TLS const char *guard_lo, *guard_hi;

static struct sigaction prev_bus; /* the handler before ours */
static volatile sig_atomic_t in_prev; /* prev_bus is running a foreign SIGBUS: one back from it ends here */
static pthread_mutex_t install_mu = PTHREAD_MUTEX_INITIALIZER;

static void on_sigbus(int sig, siginfo_t *si, void *uc)
{
    const char *a = si->si_addr;
    sigjmp_buf *env = guard_env;

    if (env && si->si_code > 0 && a >= guard_lo && a < guard_hi) {
        guard_env = NULL;
        siglongjmp(*env, 1);
    }
    /* Not a fault of a guarded copy: the handler before ours gets it. One
     * that hands it back from inside (faulthandler, enabled after us, saved
     * ours as its previous and re-raises) finds the default action here,
     * not itself again, for ever. */
    if (in_prev) {
        signal(SIGBUS, SIG_DFL);
        if (si->si_code <= 0)
            raise(sig);
        return;
    }
    if (prev_bus.sa_flags & SA_SIGINFO) {
        in_prev = 1;
        prev_bus.sa_sigaction(sig, si, uc);
        in_prev = 0;
        return;
    }
    if (prev_bus.sa_handler != SIG_DFL && prev_bus.sa_handler != SIG_IGN) {
        in_prev = 1;
        prev_bus.sa_handler(sig);
        in_prev = 0;
        return;
    }
    if (prev_bus.sa_handler == SIG_IGN && si->si_code <= 0)
        return; /* a sent SIGBUS, ignored as before */
    /* The default action: a fault re-executes and dies; a sent one is re-sent. */
    signal(SIGBUS, SIG_DFL);
    if (si->si_code <= 0)
        raise(sig);
}

/* Whether our handler is in place, putting it there (again) when another
 * took its place since (faulthandler.enable(), say); that one is then the
 * handler others' faults go to. */
static int guard_ready(void)
{
    struct sigaction cur, ours;
    int ok;

    if (sigaction(SIGBUS, NULL, &cur) == 0 && (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus)
        return 1;
    pthread_mutex_lock(&install_mu);
    memset(&ours, 0, sizeof(ours));
    ours.sa_sigaction = on_sigbus;
    /* SA_NODEFER: the jump leaves the handler without sigreturn, so SIGBUS
     * must not stay blocked in the thread afterwards. */
    ours.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    ok = sigaction(SIGBUS, NULL, &cur) == 0;
    if (ok && !((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus)) {
        prev_bus = cur;
        ok = sigaction(SIGBUS, &ours, NULL) == 0;
    }
    pthread_mutex_unlock(&install_mu);
    return ok;
}

int fx_map_guard_ready(void) { return guard_ready(); }

int64_t fx_map_copy(char *dst, const char *src, uint64_t len, const char *lo, const char *hi, int want_crc,
                    uint32_t *crc)
{
    sigjmp_buf env;
    uint32_t c = 0;

    if (src < lo || src + len > hi)
        return -EFAULT;
    guard_lo = lo;
    guard_hi = hi;
    if (sigsetjmp(env, 0)) {
#if defined(__x86_64__)
        _mm_sfence(); /* streaming stores before the fault, ordered before a retry's */
#endif
        return -EFAULT;
    }
    guard_env = &env;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    /* Summed even when not asked: the one-pass copy with streaming stores
     * is faster than memcpy from the mapping, and the sum comes with it. */
    c = fx_crc32c_copy(0, dst, src, (size_t)len);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    guard_env = NULL;
    *crc = want_crc ? c : 0;
    return (int64_t)len;
}
