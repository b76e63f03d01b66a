/* CRC32C (Castagnoli), used to verify chunk payloads in the engine thread
 * that completed them, so verification costs no GIL time.
 *
 * Implementations, one chosen once at run time from the CPU's features (each
 * compiled with a target attribute, so the file builds with default flags):
 *
 *   x86-64   "vpclmulqdq-512"     512-bit carry-less-multiply folding (AVX-512,
 *                                 Zen 4 included, see have_vpclmul512)
 *            "vpclmulqdq+crc32q"  256-bit carry-less-multiply folding and
 *                                 three crc32 streams, interleaved (AVX2)
 *            "pclmulqdq+crc32q"   the same with 128-bit folding
 *            "sse4.2"             the crc32 instruction, one stream
 *   aarch64  "armv8-pmull"        PMULL folding (CRC instructions at the end)
 *            "armv8-crc"          the CRC instructions, one stream
 *   any      "table"              slicing-by-8 tables
 *
 * Folding.  In the reflected bit order CRC32C uses, a 16-byte block is a
 * polynomial of degree < 128 whose first message bit is the highest power.
 * Appending n zero bits to data multiplies it by x^n, and the CRC depends on
 * the data only modulo P.  So eight 16-byte accumulators cover 128 bytes;
 * each step moves every accumulator 1024 bits on (multiplying its two 64-bit
 * halves by x^(1024+64) and x^1024 modulo P: two carry-less multiplies) and
 * XORs in the block that now sits there.  At the end the accumulators are
 * folded onto the last one with the constants for 7..1 blocks, and the
 * remaining 16 bytes go through the crc32 instruction (data congruent modulo
 * P has the same CRC).  The starting CRC is XORed into the first 4 bytes.
 * With 256-bit registers each holds two consecutive blocks and a step moves
 * 2048 bits, with 512-bit registers four blocks and 4096 bits.  The crc32
 * instruction runs on other execution units than the multiplier, so the
 * 128- and 256-bit paths run three crc32 streams beside the folding (see
 * "Interleaving" below): on AMD Zen 3 that is ~1.5x the folding alone and
 * ~2x the three crc32 streams alone.  The 512-bit path folds alone: what fx
 * sums is never in this core's cache (a device or another core has just
 * written it), and there the streams' extra memory traffic costs more than
 * they add (a 512-bit hybrid, tried on AMD Zen 5 and not kept, was faster
 * only on data in L2 and slower from L3 and from memory; on Zen 4, tried
 * with crc32c_speed.py, no faster in L2 or L3 and slower from memory).
 *
 * fx_crc32c_copy copies while it sums: the 512-bit folding stores every 64
 * bytes it loads to the destination with streaming stores, so a copy out of
 * a file mapping (mapped reads, csrc/mapped.c) is checked without reading the
 * bytes a second time. Without that path: a copy, then a sum, per 64 KiB.
 *
 * The constants are derived below (fold_init, hy_init) from P by repeated
 * multiplication by x, not copied from tables; a self-test against the table
 * code at start-up guards every fast path before it is chosen. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "fxio.h"

#define POLY 0x82F63B78u /* P reflected: bit 31-d holds x^d */

/* ------------------------------------------------------------------ table */

static uint32_t table[8][256];

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
}

static uint32_t crc_sw(uint32_t crc, const unsigned char *p, size_t len)
{
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= crc; /* little-endian: the first byte is the low one */
        crc = table[7][v & 0xff] ^ table[6][(v >> 8) & 0xff] ^ table[5][(v >> 16) & 0xff] ^
              table[4][(v >> 24) & 0xff] ^ table[3][(v >> 32) & 0xff] ^
              table[2][(v >> 40) & 0xff] ^ table[1][(v >> 48) & 0xff] ^ table[0][v >> 56];
        p += 8;
        len -= 8;
    }
#endif
    while (len--)
        crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff];
    return crc;
}

/* ------------------------------------------------------- fold constants */

/* x^n mod P, reflected (bit 31-d holds x^d): start at 1 and multiply by x n
 * times; multiplying a reflected value by x is a right shift, reducing x^32
 * to P's lower terms when bit 0 falls off. */
static uint32_t xpow_mod(unsigned n)
{
    uint32_t r = 0x80000000u; /* x^0 */
    while (n--)
        r = r & 1 ? (r >> 1) ^ POLY : r >> 1;
    return r;
}

/* A carry-less multiply of two reflected 64-bit halves a, b (bit i holds
 * x^(63-i)) gives a 128-bit block (bit i holds x^(127-i)) equal to x*a*b.
 * A 16-byte block is hi*x^64 + lo in those terms where "hi" is its first 8
 * bytes.  Moving the block n bits on: hi*x^(64+n) + lo*x^n, so the
 * constants are x^(63+n) and x^(n-1) mod P, placed so that bit 63-d holds
 * x^d (the reflected 32-bit value shifted up by 32).
 * fold_k[j] moves a block j*16 bytes: {first-half constant, second-half}. */
#define FOLD_MAX 32
static uint64_t fold_k[FOLD_MAX + 1][2];

static void fold_init(void)
{
    for (unsigned j = 1; j <= FOLD_MAX; j++) {
        unsigned n = 128 * j;
        fold_k[j][0] = (uint64_t)xpow_mod(63 + n) << 32;
        fold_k[j][1] = (uint64_t)xpow_mod(n - 1) << 32;
    }
}

/* ------------------------------------------------------------------ x86 */

#if defined(__x86_64__)
#include <immintrin.h>

#define X86_CRC __attribute__((target("sse4.2")))
#define X86_CLMUL __attribute__((target("sse4.2,pclmul")))
#define X86_VCLMUL __attribute__((target("sse4.2,pclmul,avx2,vpclmulqdq")))

X86_CRC static inline uint32_t crc_u64(uint32_t c, const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return (uint32_t)_mm_crc32_u64(c, v);
}

X86_CRC static uint32_t crc_sse42(uint32_t crc, const unsigned char *p, size_t len)
{
    while (len >= 8) {
        crc = crc_u64(crc, p);
        p += 8;
        len -= 8;
    }
    while (len--)
        crc = _mm_crc32_u8(crc, *p++);
    return crc;
}

X86_CLMUL static inline __m128i fold128(__m128i a, const uint64_t k[2])
{
    __m128i kk = _mm_set_epi64x((long long)k[1], (long long)k[0]);
    return _mm_xor_si128(_mm_clmulepi64_si128(a, kk, 0x00), _mm_clmulepi64_si128(a, kk, 0x11));
}

/* Eight consecutive 16-byte blocks (x7 the last) to a CRC, then the tail. */
X86_CLMUL static inline uint32_t fold_finish(__m128i x0, __m128i x1, __m128i x2, __m128i x3,
                                             __m128i x4, __m128i x5, __m128i x6, __m128i x7,
                                             const unsigned char *p, size_t len)
{
    unsigned char b[16];
    __m128i v = _mm_xor_si128(_mm_xor_si128(fold128(x0, fold_k[7]), fold128(x1, fold_k[6])),
                              _mm_xor_si128(fold128(x2, fold_k[5]), fold128(x3, fold_k[4])));
    v = _mm_xor_si128(v, _mm_xor_si128(_mm_xor_si128(fold128(x4, fold_k[3]), fold128(x5, fold_k[2])),
                                       _mm_xor_si128(fold128(x6, fold_k[1]), x7)));
    _mm_storeu_si128((__m128i *)b, v);
    return crc_sse42(crc_u64(crc_u64(0, b), b + 8), p, len);
}

/* One folding step for accumulator x over the block at q (k: the constants). */
#define FOLD_STEP(x, q, k, clmul, xor, load)                                                   \
    x = xor(xor(clmul(x, k, 0x00), clmul(x, k, 0x11)), load(q))
#define LOAD128(q) _mm_loadu_si128((const __m128i *)(q))
#define LOAD256(q) _mm256_loadu_si256((const __m256i *)(q))

/* 128 bytes a step in eight 128-bit accumulators; len >= 256. */
X86_CLMUL static uint32_t crc_pclmul(uint32_t crc, const unsigned char *p, size_t len)
{
    const __m128i k = _mm_set_epi64x((long long)fold_k[8][1], (long long)fold_k[8][0]);
    __m128i x0, x1, x2, x3, x4, x5, x6, x7;

    if (len < 256)
        return crc_sse42(crc, p, len);
    x0 = _mm_xor_si128(LOAD128(p), _mm_cvtsi32_si128((int)crc));
    x1 = LOAD128(p + 16);
    x2 = LOAD128(p + 32);
    x3 = LOAD128(p + 48);
    x4 = LOAD128(p + 64);
    x5 = LOAD128(p + 80);
    x6 = LOAD128(p + 96);
    x7 = LOAD128(p + 112);
    p += 128;
    len -= 128;
    while (len >= 128) {
        FOLD_STEP(x0, p, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        FOLD_STEP(x1, p + 16, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        FOLD_STEP(x2, p + 32, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        FOLD_STEP(x3, p + 48, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        FOLD_STEP(x4, p + 64, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        FOLD_STEP(x5, p + 80, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        FOLD_STEP(x6, p + 96, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        FOLD_STEP(x7, p + 112, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        p += 128;
        len -= 128;
    }
    return fold_finish(x0, x1, x2, x3, x4, x5, x6, x7, p, len);
}

/* Eight 256-bit accumulators over 256 consecutive bytes to a CRC, then the
 * tail: y0..y3 move 128 bytes on, onto y4..y7, leaving eight 16-byte blocks. */
X86_VCLMUL static inline uint32_t finish256(__m256i y0, __m256i y1, __m256i y2, __m256i y3,
                                            __m256i y4, __m256i y5, __m256i y6, __m256i y7,
                                            __m256i k8, const unsigned char *p, size_t len)
{
#define FOLD_ONTO(y, z)                                                                        \
    _mm256_xor_si256(                                                                          \
        _mm256_xor_si256(_mm256_clmulepi64_epi128(y, k8, 0x00), _mm256_clmulepi64_epi128(y, k8, 0x11)), \
        z)
    y0 = FOLD_ONTO(y0, y4);
    y1 = FOLD_ONTO(y1, y5);
    y2 = FOLD_ONTO(y2, y6);
    y3 = FOLD_ONTO(y3, y7);
#undef FOLD_ONTO
    return fold_finish(_mm256_castsi256_si128(y0), _mm256_extracti128_si256(y0, 1),
                       _mm256_castsi256_si128(y1), _mm256_extracti128_si256(y1, 1),
                       _mm256_castsi256_si128(y2), _mm256_extracti128_si256(y2, 1),
                       _mm256_castsi256_si128(y3), _mm256_extracti128_si256(y3, 1), p, len);
}

/* 256 bytes a step in eight 256-bit accumulators (two blocks each); len >= 512. */
X86_VCLMUL static uint32_t crc_vpclmul(uint32_t crc, const unsigned char *p, size_t len)
{
    const __m256i k = _mm256_set_epi64x((long long)fold_k[16][1], (long long)fold_k[16][0],
                                        (long long)fold_k[16][1], (long long)fold_k[16][0]);
    const __m256i k8 = _mm256_set_epi64x((long long)fold_k[8][1], (long long)fold_k[8][0],
                                         (long long)fold_k[8][1], (long long)fold_k[8][0]);
    __m256i y0, y1, y2, y3, y4, y5, y6, y7;

    if (len < 512)
        return crc_pclmul(crc, p, len);
    y0 = _mm256_xor_si256(LOAD256(p), _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)crc)));
    y1 = LOAD256(p + 32);
    y2 = LOAD256(p + 64);
    y3 = LOAD256(p + 96);
    y4 = LOAD256(p + 128);
    y5 = LOAD256(p + 160);
    y6 = LOAD256(p + 192);
    y7 = LOAD256(p + 224);
    p += 256;
    len -= 256;
    while (len >= 256) {
        FOLD_STEP(y0, p, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        FOLD_STEP(y1, p + 32, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        FOLD_STEP(y2, p + 64, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        FOLD_STEP(y3, p + 96, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        FOLD_STEP(y4, p + 128, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        FOLD_STEP(y5, p + 160, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        FOLD_STEP(y6, p + 192, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        FOLD_STEP(y7, p + 224, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        p += 256;
        len -= 256;
    }
    return finish256(y0, y1, y2, y3, y4, y5, y6, y7, k8, p, len);
}

#define X86_VCLMUL512 __attribute__((target("sse4.2,pclmul,avx2,avx512f,avx512vl,vpclmulqdq")))

X86_VCLMUL512 static inline __m512i k512(const uint64_t k[2])
{
    return _mm512_set_epi64((long long)k[1], (long long)k[0], (long long)k[1], (long long)k[0],
                            (long long)k[1], (long long)k[0], (long long)k[1], (long long)k[0]);
}

/* x moved on by k's distance, XORed with q (one three-way XOR). */
X86_VCLMUL512 static inline __m512i fold512(__m512i x, __m512i k, __m512i q)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                     _mm512_clmulepi64_epi128(x, k, 0x11), q, 0x96);
}

#define LOAD512(q) _mm512_loadu_si512((const void *)(q))

/* 512 bytes a step in eight 512-bit accumulators (four blocks each). With
 * d, every byte summed is also stored there: the copy rides on the loads the
 * folding makes anyway, with streaming stores (not read back here, and they
 * spare the cache line's read for ownership); d is then 64-byte aligned.
 * Inlined into its two callers, so the test of d folds away. len >= 1024. */
X86_VCLMUL512 static inline __attribute__((always_inline)) uint32_t
fold512_body(uint32_t crc, const unsigned char *p, size_t len, unsigned char *d)
{
    const __m512i k = k512(fold_k[32]), k16 = k512(fold_k[16]), k8 = k512(fold_k[8]);
    const __m128i c = _mm_cvtsi32_si128((int)crc);
    __m512i z[8];

#define COPY512(o, v)                                                                          \
    do {                                                                                       \
        if (d)                                                                                 \
            _mm512_stream_si512((void *)(d + (o)), v);                                         \
    } while (0)
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        z[j] = LOAD512(p + 64 * j);
        COPY512(64 * j, z[j]);
    }
    z[0] = _mm512_xor_si512(z[0], _mm512_inserti32x4(_mm512_setzero_si512(), c, 0));
    p += 512;
    d = d ? d + 512 : NULL;
    len -= 512;
    while (len >= 512) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m512i v = LOAD512(p + 64 * j);
            COPY512(64 * j, v);
            z[j] = fold512(z[j], k, v);
        }
        p += 512;
        d = d ? d + 512 : NULL;
        len -= 512;
    }
#undef COPY512
    if (d) {
        memcpy(d, p, len); /* the tail, summed below from the copy: a shared mapping's */
        p = d;             /* bytes may change between two reads, and the CRC must be of those copied */
        _mm_sfence();      /* streaming stores ordered before whatever follows */
    }
    /* 32 blocks to 8: z0..z3 move 256 bytes on, onto z4..z7; z4, z5 then
     * 128 bytes, onto z6, z7; those eight blocks go as the other paths' do. */
    z[4] = fold512(z[0], k16, z[4]);
    z[5] = fold512(z[1], k16, z[5]);
    z[6] = fold512(z[2], k16, z[6]);
    z[7] = fold512(z[3], k16, z[7]);
    z[6] = fold512(z[4], k8, z[6]);
    z[7] = fold512(z[5], k8, z[7]);
    return fold_finish(_mm512_extracti32x4_epi32(z[6], 0), _mm512_extracti32x4_epi32(z[6], 1),
                       _mm512_extracti32x4_epi32(z[6], 2), _mm512_extracti32x4_epi32(z[6], 3),
                       _mm512_extracti32x4_epi32(z[7], 0), _mm512_extracti32x4_epi32(z[7], 1),
                       _mm512_extracti32x4_epi32(z[7], 2), _mm512_extracti32x4_epi32(z[7], 3), p, len);
}

/* Below 1024 bytes the 256-bit path. */
X86_VCLMUL512 static uint32_t crc_vpclmul512(uint32_t crc, const unsigned char *p, size_t len)
{
    return len < 1024 ? crc_vpclmul(crc, p, len) : fold512_body(crc, p, len, NULL);
}

/* Copy and sum in one pass; dst 64-byte aligned, len >= 1024. */
X86_VCLMUL512 static uint32_t crc_copy512(uint32_t crc, unsigned char *dst, const unsigned char *p,
                                          size_t len)
{
    return fold512_body(crc, p, len, dst);
}

/* Interleaving: the crc32 instruction and the carry-less multiplier run on
 * different execution units, so a round folds one stretch of the buffer
 * while three crc32 streams run over the three stretches after it:
 *
 *     | fold: 8 vector blocks a step | stream 1 | stream 2 | stream 3 |
 *
 * Each step folds one vector block set (128 or 256 bytes) and advances each
 * stream by 64 bytes, so a round of m steps covers m*(128 or 256) + 3*64*m
 * bytes.  The four partial CRCs are then joined: a CRC is carried over n
 * following bytes by multiplying it by x^(8n) mod P (crc_shift). */
#define HY_STREAM 64 /* bytes per stream per step */
static const unsigned hy_steps[] = {64, 32, 16, 8, 4};
#define HY_ROUNDS (sizeof(hy_steps) / sizeof(hy_steps[0]))
static uint64_t hy_k[HY_ROUNDS][3]; /* carry over 1, 2, 3 streams' bytes */

/* Carrying CRC c over n bytes is c*x^(8n) mod P.  With c and k in the low
 * 32 bits of 64-bit lanes, the carry-less multiply leaves c*k*x in the first
 * 8 bytes of the product (same conventions as the fold constants), and the
 * crc32 instruction over those 8 bytes multiplies by x^32 mod P: so
 * k = x^(8n-33) mod P (n >= 5 bytes). */
static uint64_t shift_const(uint64_t nbytes) { return xpow_mod((unsigned)(8 * nbytes - 33)); }

static void hy_init(void)
{
    for (size_t r = 0; r < HY_ROUNDS; r++)
        for (unsigned j = 1; j <= 3; j++)
            hy_k[r][j - 1] = shift_const((uint64_t)HY_STREAM * hy_steps[r] * j);
}

X86_CLMUL static inline uint32_t crc_shift(uint32_t c, uint64_t k)
{
    __m128i pr = _mm_clmulepi64_si128(_mm_cvtsi32_si128((int)c), _mm_cvtsi64_si128((long long)k), 0);
    return (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(pr));
}

/* Advances the three stream CRCs by 8 bytes at offset o of each stream. */
#define CRC3(s, c, o)                                                                          \
    do {                                                                                       \
        uint64_t v1_, v2_, v3_;                                                                \
        memcpy(&v1_, (s) + (o), 8);                                                            \
        memcpy(&v2_, (s) + (c) + (o), 8);                                                      \
        memcpy(&v3_, (s) + 2 * (c) + (o), 8);                                                  \
        b1 = _mm_crc32_u64(b1, v1_);                                                           \
        b2 = _mm_crc32_u64(b2, v2_);                                                           \
        b3 = _mm_crc32_u64(b3, v3_);                                                           \
    } while (0)
#define CRC3_STEP(s, c)                                                                        \
    do {                                                                                       \
        CRC3(s, c, 0);                                                                         \
        CRC3(s, c, 8);                                                                         \
        CRC3(s, c, 16);                                                                        \
        CRC3(s, c, 24);                                                                        \
        CRC3(s, c, 32);                                                                        \
        CRC3(s, c, 40);                                                                        \
        CRC3(s, c, 48);                                                                        \
        CRC3(s, c, 56);                                                                        \
        (s) += HY_STREAM;                                                                      \
    } while (0)
#define HY_JOIN(a, r)                                                                          \
    (crc_shift(a, hy_k[r][2]) ^ crc_shift((uint32_t)b1, hy_k[r][1]) ^                         \
     crc_shift((uint32_t)b2, hy_k[r][0]) ^ (uint32_t)b3)

/* One round with 128-bit folding over m*320 bytes. */
X86_CLMUL static uint32_t hy_round128(uint32_t crc, const unsigned char *p, size_t r)
{
    const __m128i k = _mm_set_epi64x((long long)fold_k[8][1], (long long)fold_k[8][0]);
    const size_t m = hy_steps[r], c = (size_t)HY_STREAM * m;
    const unsigned char *s = p + 128 * m;
    uint64_t b1 = 0, b2 = 0, b3 = 0;
    __m128i x0, x1, x2, x3, x4, x5, x6, x7;

    x0 = _mm_xor_si128(LOAD128(p), _mm_cvtsi32_si128((int)crc));
    x1 = LOAD128(p + 16);
    x2 = LOAD128(p + 32);
    x3 = LOAD128(p + 48);
    x4 = LOAD128(p + 64);
    x5 = LOAD128(p + 80);
    x6 = LOAD128(p + 96);
    x7 = LOAD128(p + 112);
    CRC3_STEP(s, c);
    for (size_t i = 1; i < m; i++) {
        p += 128;
        FOLD_STEP(x0, p, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        FOLD_STEP(x1, p + 16, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        FOLD_STEP(x2, p + 32, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        FOLD_STEP(x3, p + 48, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        FOLD_STEP(x4, p + 64, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        FOLD_STEP(x5, p + 80, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        FOLD_STEP(x6, p + 96, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        FOLD_STEP(x7, p + 112, k, _mm_clmulepi64_si128, _mm_xor_si128, LOAD128);
        CRC3_STEP(s, c);
    }
    return HY_JOIN(fold_finish(x0, x1, x2, x3, x4, x5, x6, x7, p, 0), r);
}

/* One round with 256-bit folding over m*448 bytes. */
X86_VCLMUL static uint32_t hy_round256(uint32_t crc, const unsigned char *p, size_t r)
{
    const __m256i k = _mm256_set_epi64x((long long)fold_k[16][1], (long long)fold_k[16][0],
                                        (long long)fold_k[16][1], (long long)fold_k[16][0]);
    const __m256i k8 = _mm256_set_epi64x((long long)fold_k[8][1], (long long)fold_k[8][0],
                                         (long long)fold_k[8][1], (long long)fold_k[8][0]);
    const size_t m = hy_steps[r], c = (size_t)HY_STREAM * m;
    const unsigned char *s = p + 256 * m;
    uint64_t b1 = 0, b2 = 0, b3 = 0;
    __m256i y0, y1, y2, y3, y4, y5, y6, y7;

    y0 = _mm256_xor_si256(LOAD256(p), _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)crc)));
    y1 = LOAD256(p + 32);
    y2 = LOAD256(p + 64);
    y3 = LOAD256(p + 96);
    y4 = LOAD256(p + 128);
    y5 = LOAD256(p + 160);
    y6 = LOAD256(p + 192);
    y7 = LOAD256(p + 224);
    CRC3_STEP(s, c);
    for (size_t i = 1; i < m; i++) {
        p += 256;
        FOLD_STEP(y0, p, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        FOLD_STEP(y1, p + 32, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        FOLD_STEP(y2, p + 64, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        FOLD_STEP(y3, p + 96, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        FOLD_STEP(y4, p + 128, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        FOLD_STEP(y5, p + 160, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        FOLD_STEP(y6, p + 192, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        FOLD_STEP(y7, p + 224, k, _mm256_clmulepi64_epi128, _mm256_xor_si256, LOAD256);
        CRC3_STEP(s, c);
    }
    return HY_JOIN(finish256(y0, y1, y2, y3, y4, y5, y6, y7, k8, p, 0), r);
}

X86_CLMUL static uint32_t crc_hy128(uint32_t crc, const unsigned char *p, size_t len)
{
    for (size_t r = 0; r < HY_ROUNDS; r++) {
        const size_t n = (size_t)hy_steps[r] * (128 + 3 * HY_STREAM);
        for (; len >= n; p += n, len -= n)
            crc = hy_round128(crc, p, r);
    }
    return crc_pclmul(crc, p, len);
}

X86_VCLMUL static uint32_t crc_hy256(uint32_t crc, const unsigned char *p, size_t len)
{
    for (size_t r = 0; r < HY_ROUNDS; r++) {
        const size_t n = (size_t)hy_steps[r] * (256 + 3 * HY_STREAM);
        for (; len >= n; p += n, len -= n)
            crc = hy_round256(crc, p, r);
    }
    return crc_vpclmul(crc, p, len);
}

static int have_sse42(void) { return __builtin_cpu_supports("sse4.2"); }
static int have_pclmul(void) { return have_sse42() && __builtin_cpu_supports("pclmul"); }
static int have_vpclmul(void)
{
    return have_pclmul() && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("vpclmulqdq");
}
/* __builtin_cpu_supports("avx512f") also asks the OS saves the ZMM state. */
static int have_vpclmul512(void)
{
    /* Zen 4 too, though it runs a 512-bit operation as two halves: measured on one
     * (family 19h model 11h), 2 MiB in cache, 49.6 GB/s against the 256-bit path's
     * 27.5-34.8, and the one-pass copy 24.2 against 19.0 (staged reads need it). */
    return have_vpclmul() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
}

/* ---------------------------------------------------------------- aarch64 */

#elif defined(__aarch64__) && defined(__GNUC__)
#include <arm_acle.h>
#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif
#ifndef HWCAP_PMULL
#define HWCAP_PMULL (1 << 4)
#endif
#endif

#if defined(__clang__)
#define ARM_CRC __attribute__((target("crc")))
#define ARM_PMULL __attribute__((target("crc,aes")))
#else
#define ARM_CRC __attribute__((target("+crc")))
#define ARM_PMULL __attribute__((target("+crc+crypto"))) /* GCC 12 puts vmull_p64 under +crypto */
#endif

ARM_CRC static uint32_t crc_armv8(uint32_t crc, const unsigned char *p, size_t len)
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

ARM_PMULL static inline uint64x2_t pmull_fold(uint64x2_t a, uint64x2_t k)
{
    poly128_t lo = vmull_p64((poly64_t)vgetq_lane_u64(a, 0), (poly64_t)vgetq_lane_u64(k, 0));
    poly128_t hi = vmull_high_p64(vreinterpretq_p64_u64(a), vreinterpretq_p64_u64(k));
    return veorq_u64(vreinterpretq_u64_p128(lo), vreinterpretq_u64_p128(hi));
}

/* Same scheme as the x86 folding: eight accumulators, 128 bytes a step. */
ARM_PMULL static uint32_t crc_pmull(uint32_t crc, const unsigned char *p, size_t len)
{
    uint64x2_t x[8], v;
    const uint64x2_t k = vcombine_u64(vcreate_u64(fold_k[8][0]), vcreate_u64(fold_k[8][1]));
    uint64_t b[2];

    if (len < 256)
        return crc_armv8(crc, p, len);
    for (int i = 0; i < 8; i++)
        x[i] = vreinterpretq_u64_u8(vld1q_u8(p + 16 * i));
    x[0] = veorq_u64(x[0], vcombine_u64(vcreate_u64(crc), vcreate_u64(0)));
    p += 128;
    len -= 128;
    while (len >= 128) {
        for (int i = 0; i < 8; i++)
            x[i] = veorq_u64(pmull_fold(x[i], k), vreinterpretq_u64_u8(vld1q_u8(p + 16 * i)));
        p += 128;
        len -= 128;
    }
    v = x[7];
    for (int i = 0; i < 7; i++) {
        const uint64x2_t kj =
            vcombine_u64(vcreate_u64(fold_k[7 - i][0]), vcreate_u64(fold_k[7 - i][1]));
        v = veorq_u64(v, pmull_fold(x[i], kj));
    }
    vst1q_u64(b, v);
    return crc_armv8(__crc32cd(__crc32cd(0, b[0]), b[1]), p, len);
}

#if defined(__linux__)
static int have_armcrc(void) { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
static int have_pmull(void) { return have_armcrc() && (getauxval(AT_HWCAP) & HWCAP_PMULL) != 0; }
#else
static int have_armcrc(void)
{
#if defined(__ARM_FEATURE_CRC32)
    return 1;
#else
    return 0;
#endif
}
static int have_pmull(void)
{
#if defined(__ARM_FEATURE_CRC32) && (defined(__ARM_FEATURE_AES) || defined(__ARM_FEATURE_CRYPTO))
    return 1;
#else
    return 0;
#endif
}
#endif
#endif

/* --------------------------------------------------------------- dispatch */

typedef uint32_t (*crc_fn)(uint32_t, const unsigned char *, size_t);

/* The candidates, fastest first; the first this CPU has that passes the
 * self-test is the one used. The table code, last, is the reference of the
 * self-test and needs neither (have is NULL). */
static const struct {
    const char *name;
    crc_fn fn;
    int (*have)(void);
} impls[] = {
#if defined(__x86_64__)
    {"vpclmulqdq-512", crc_vpclmul512, have_vpclmul512},
    {"vpclmulqdq+crc32q", crc_hy256, have_vpclmul},
    {"pclmulqdq+crc32q", crc_hy128, have_pclmul},
    {"sse4.2", crc_sse42, have_sse42},
#elif defined(__aarch64__) && defined(__GNUC__)
    {"armv8-pmull", crc_pmull, have_pmull},
    {"armv8-crc", crc_armv8, have_armcrc},
#endif
    {"table", crc_sw, NULL},
};
#define NIMPLS (sizeof(impls) / sizeof(impls[0]))

static int impl_ok[NIMPLS]; /* this CPU has it and it passed the self-test */
static int copy512_ok;      /* crc_copy512 runs here and passed its self-test */
static crc_fn impl_fn = crc_sw;
static const char *impl_name = "table";
static pthread_once_t impl_once = PTHREAD_ONCE_INIT;

/* Whether fn agrees with the table code over len bytes at two alignments. */
static int agrees(crc_fn fn, const unsigned char *buf, size_t len)
{
    for (size_t off = 0; off < 2; off++) {
        uint32_t seed = (uint32_t)(len * 0x01000193u) ^ 0xFFFFFFFFu;
        if (fn(seed, buf + off * 7, len) != crc_sw(seed, buf + off * 7, len))
            return 0;
    }
    return 1;
}

/* Every length to 300, a spread to 2200 and lengths around each round size:
 * every path and many tails. */
static int self_test(crc_fn fn)
{
    static unsigned char buf[30000];
    static const size_t big[] = {3583, 3584, 4096, 7168 + 5, 14336 + 17, 20480 - 1, 28672 + 999,
                                 sizeof(buf) - 7};
    uint32_t s = 0x9E3779B9u;

    for (size_t i = 0; i < sizeof(buf); i++) {
        s = s * 1664525u + 1013904223u;
        buf[i] = (unsigned char)(s >> 24);
    }
    for (size_t len = 0; len <= 2200; len += len < 300 ? 1 : 37)
        if (!agrees(fn, buf, len))
            return 0;
    for (size_t i = 0; i < sizeof(big) / sizeof(big[0]); i++)
        if (!agrees(fn, buf, big[i]))
            return 0;
    return 1;
}

#if defined(__x86_64__)
/* crc_copy512 against the table code, and its copy against the source,
 * over lengths around its steps and tails. */
static int copy_self_test(void)
{
    static unsigned char src[9000];
    static unsigned char dst[9000 + 64] __attribute__((aligned(64)));
    static const size_t lens[] = {1024, 1025, 1535, 1536, 2047, 4096, 4096 + 300, 8191, 9000 - 1};
    uint32_t s = 0x2545F491u;

    for (size_t i = 0; i < sizeof(src); i++) {
        s = s * 1664525u + 1013904223u;
        src[i] = (unsigned char)(s >> 24);
    }
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
        size_t len = lens[i] > sizeof(src) - 1 ? sizeof(src) - 1 : lens[i];
        uint32_t seed = (uint32_t)(len * 0x01000193u) ^ 0xFFFFFFFFu;

        memset(dst, 0, sizeof(dst));
        if (crc_copy512(seed, dst, src + 1, len) != crc_sw(seed, src + 1, len) ||
            memcmp(dst, src + 1, len) != 0 || dst[len] != 0)
            return 0;
    }
    return 1;
}
#endif

static void impl_init(void)
{
    build_table();
    fold_init();
#if defined(__x86_64__)
    hy_init();
#endif
    for (size_t i = NIMPLS; i-- > 0;) {
        impl_ok[i] = !impls[i].have || (impls[i].have() && self_test(impls[i].fn));
        if (impl_ok[i]) {
            impl_fn = impls[i].fn;
            impl_name = impls[i].name;
        }
    }
#if defined(__x86_64__)
    copy512_ok = impl_fn == crc_vpclmul512 && copy_self_test();
#endif
}

uint32_t fx_crc32c(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&impl_once, impl_init);
    return ~impl_fn(~crc, buf, len);
}

uint32_t fx_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len)
{
    unsigned char *d = dst;
    const unsigned char *p = src;

    pthread_once(&impl_once, impl_init);
#if defined(__x86_64__)
    if (copy512_ok && len >= 1024 && ((uintptr_t)d & 63) == 0)
        return ~crc_copy512(~crc, d, p, len);
#endif
    /* Elsewhere: copy a stretch, then sum it while it is in this core's cache. */
    while (len) {
        size_t n = len < (64u << 10) ? len : (64u << 10);

        memcpy(d, p, n);
        crc = fx_crc32c(crc, d, n);
        d += n;
        p += n;
        len -= n;
    }
    return crc;
}

int fx_crc32c_copy_one_pass(void)
{
    pthread_once(&impl_once, impl_init);
    return copy512_ok;
}

const char *fx_crc32c_impl(void)
{
    pthread_once(&impl_once, impl_init);
    return impl_name;
}

size_t fx_crc32c_impls(const char **names, size_t max)
{
    size_t n = 0;

    pthread_once(&impl_once, impl_init);
    for (size_t i = 0; i < NIMPLS; i++)
        if (impl_ok[i] && n < max)
            names[n++] = impls[i].name;
    return n;
}

int fx_crc32c_with(const char *name, uint32_t crc, const void *buf, size_t len, uint32_t *out)
{
    pthread_once(&impl_once, impl_init);
    for (size_t i = 0; i < NIMPLS; i++)
        if (impl_ok[i] && strcmp(impls[i].name, name) == 0) {
            *out = ~impls[i].fn(~crc, buf, len);
            return 0;
        }
    return -1;
}

/* ------------------------------------------------------------- combining */

/* Appending len_b bytes multiplies crc_a by x^(8*len_b) modulo the
 * polynomial, a linear map on 32 bits. shift_op[k] holds the map for 2^k
 * bytes as 32 column images; a combine applies one map per set bit. */
static uint32_t shift_op[64][32];
static pthread_once_t shift_once = PTHREAD_ONCE_INIT;

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
}

uint32_t fx_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b)
{
    pthread_once(&shift_once, build_shift_ops);
    for (int k = 0; len_b; k++, len_b >>= 1)
        if (len_b & 1)
            crc_a = apply_op(shift_op[k], crc_a);
    return crc_a ^ crc_b;
}
