/* CRC32C (Castagnoli): SSE4.2 or ARMv8 CRC instructions when the CPU has
 * them, a slicing-by-8 table otherwise. Used to verify chunk payloads in the
 * engine thread that completed them, so verification costs no GIL time. */
#include <stdint.h>
#include <string.h>

#include "fxio.h"

#define POLY 0x82F63B78u

static uint32_t table[8][256];
static int table_ready;

static void build_table(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
    __atomic_store_n(&table_ready, 1, __ATOMIC_RELEASE);
}

static uint32_t crc_sw(uint32_t crc, const unsigned char *p, size_t len)
{
    if (!__atomic_load_n(&table_ready, __ATOMIC_ACQUIRE))
        build_table(); /* idempotent: racing builders write equal values */
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= crc;
        crc = table[7][v & 0xff] ^ table[6][(v >> 8) & 0xff] ^ table[5][(v >> 16) & 0xff] ^
              table[4][(v >> 24) & 0xff] ^ table[3][(v >> 32) & 0xff] ^
              table[2][(v >> 40) & 0xff] ^ table[1][(v >> 48) & 0xff] ^ table[0][v >> 56];
        p += 8;
        len -= 8;
    }
    while (len--)
        crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff];
    return crc;
}

static void build_shift_ops(void);
static uint32_t apply_op(const uint32_t *op, uint32_t v);

#if defined(__x86_64__)
#include <nmmintrin.h>

/* Three interleaved streams over STRIPE-byte blocks keep the CRC unit busy
 * (the instruction has 3-cycle latency, 1-cycle throughput); their registers
 * are joined with byte-indexed tables for "shift by STRIPE / 2*STRIPE bytes". */
#define STRIPE 8192
static uint32_t shift1_tab[4][256], shift2_tab[4][256];
static int stripe_ready;

static void build_stripe_tables(void)
{
    for (int j = 0; j < 4; j++)
        for (uint32_t x = 0; x < 256; x++) {
            shift1_tab[j][x] = fx_crc32c_combine(x << (8 * j), 0, STRIPE);
            shift2_tab[j][x] = fx_crc32c_combine(x << (8 * j), 0, 2 * STRIPE);
        }
    __atomic_store_n(&stripe_ready, 1, __ATOMIC_RELEASE);
}

static inline uint32_t shift_by(uint32_t tab[4][256], uint32_t v)
{
    return tab[0][v & 0xff] ^ tab[1][(v >> 8) & 0xff] ^ tab[2][(v >> 16) & 0xff] ^ tab[3][v >> 24];
}
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p,
                                                          size_t len)
{
    uint64_t c = crc;
    while (len && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        len--;
    }
    if (len >= 3 * STRIPE && !__atomic_load_n(&stripe_ready, __ATOMIC_ACQUIRE))
        build_stripe_tables();
    while (len >= 3 * STRIPE) {
        uint64_t a = c, b = 0, d = 0;
        for (size_t i = 0; i < STRIPE; i += 8) {
            uint64_t v0, v1, v2;
            memcpy(&v0, p + i, 8);
            memcpy(&v1, p + STRIPE + i, 8);
            memcpy(&v2, p + 2 * STRIPE + i, 8);
            a = _mm_crc32_u64(a, v0);
            b = _mm_crc32_u64(b, v1);
            d = _mm_crc32_u64(d, v2);
        }
        c = shift_by(shift2_tab, (uint32_t)a) ^ shift_by(shift1_tab, (uint32_t)b) ^ (uint32_t)d;
        p += 3 * STRIPE;
        len -= 3 * STRIPE;
    }
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
        p += 8;
        len -= 8;
    }
    while (len--)
        c = _mm_crc32_u8((uint32_t)c, *p++);
    return (uint32_t)c;
}
static int hw_ok(void) { return __builtin_cpu_supports("sse4.2"); }
#define HW_NAME "sse4.2"
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t len)
{
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        crc = __crc32cd(crc, v);
        p += 8;
        len -= 8;
    }
    while (len--)
        crc = __crc32cb(crc, *p++);
    return crc;
}
static int hw_ok(void) { return 1; }
#define HW_NAME "armv8-crc"
#else
static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t len)
{
    return crc_sw(crc, p, len);
}
static int hw_ok(void) { return 0; }
#define HW_NAME "table"
#endif

uint32_t fx_crc32c(uint32_t crc, const void *buf, size_t len)
{
    static int mode = -1; /* -1 unknown, 0 table, 1 hardware */
    const unsigned char *p = buf;

    if (mode < 0)
        mode = hw_ok();
    crc = ~crc;
    crc = mode ? crc_hw(crc, p, len) : crc_sw(crc, p, len);
    return ~crc;
}

/* Combining: appending len_b bytes multiplies crc_a by x^(8*len_b) modulo
 * the polynomial, a linear map on 32 bits. shift_op[k] holds the map for
 * 2^k bytes as 32 column images; a combine applies one map per set bit. */
static uint32_t shift_op[64][32];
static int shift_ready;

static uint32_t apply_op(const uint32_t *op, uint32_t v)
{
    uint32_t r = 0;
    for (int n = 0; v; n++, v >>= 1)
        if (v & 1)
            r ^= op[n];
    return r;
}

static void build_shift_ops(void)
{
    uint32_t bit[32], tmp[32];

    /* One zero bit into a reflected CRC: v -> (v >> 1) ^ (v & 1 ? POLY : 0). */
    bit[0] = POLY;
    for (int n = 1; n < 32; n++)
        bit[n] = 1u << (n - 1);
    memcpy(tmp, bit, sizeof(tmp));
    for (int s = 1; s < 8; s++) /* eight bits: one byte */
        for (int n = 0; n < 32; n++)
            tmp[n] = apply_op(bit, tmp[n]);
    memcpy(shift_op[0], tmp, sizeof(tmp));
    for (int k = 1; k < 64; k++)
        for (int n = 0; n < 32; n++)
            shift_op[k][n] = apply_op(shift_op[k - 1], shift_op[k - 1][n]);
    __atomic_store_n(&shift_ready, 1, __ATOMIC_RELEASE);
}

uint32_t fx_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b)
{
    if (!__atomic_load_n(&shift_ready, __ATOMIC_ACQUIRE))
        build_shift_ops(); /* idempotent: racing builders write equal values */
    for (int k = 0; len_b; k++, len_b >>= 1)
        if (len_b & 1)
            crc_a = apply_op(shift_op[k], crc_a);
    return crc_a ^ crc_b;
}

const char *fx_crc32c_impl(void) { return hw_ok() ? HW_NAME : "table"; }
