/* porter.format.mxfp8's CPU quantization rule in C, for porter.format.mxfp8_native (compiled on first use
 * with the system C compiler, loaded with ctypes, called with the GIL released).
 *
 * The rule, step for step as porter/format/mxfp8.py states it:
 *   - block amax over 32 values in fp32 (exact);
 *   - scale byte from amax's bits: rceil k = (bits + 0x1FFFFF) >> 23, floor k = bits >> 23, byte = max(k-8, 0);
 *   - x = w * 2^(127 - byte) in fp32 (exact power-of-two scaling), floor's x clipped to +-448 for the cast;
 *   - round to nearest even onto the e4m3 grid: 3 mantissa bits from 2^-6 up, steps of 2^-9 below;
 *   - per block, in fp32: ||w||^2, ||x - q||^2 and max |x - q| (x unclipped), written out for
 *     porter.format.mxfp8._error_totals to sum in float64.
 * Written with GCC/Clang vector extensions, LANES lanes of 32 bits: 16 (one AVX-512 register) where the
 * target has AVX-512F, else 8 (one AVX2 register: 16 lanes split over two narrower registers lose more than
 * they gain; docs/mxfp8.md). -DPORTER_LANES=8|16 overrides the choice. Branch-free within a block; the one
 * branch per block picks the slower rounding only where some value can land among e4m3's subnormals.
 * Blocks go LANES at a time (quantize_group): their amax, amin and three statistics each come out of one
 * transposed reduction over the LANES blocks instead of one tree per block (the same pairs, so the same
 * bits, with fewer shuffles); the last nb % LANES blocks go through it too, padded with all-zero blocks.
 * Built without -ffast-math and with -ffp-contract=off: every float operation stays one IEEE operation
 * (no fused multiply-add in the sums), subnormals included.
 *
 * porter_mxfp8_quantize returns the number of blocks holding a NaN or an infinity: nothing is to be trusted
 * then, and the caller re-runs the tensor through the torch path, which names it.
 */
#include <stdint.h>
#include <string.h>

#define BLOCK 32

#ifndef PORTER_LANES
#ifdef __AVX512F__
#define PORTER_LANES 16
#else
#define PORTER_LANES 8
#endif
#endif
#define LANES PORTER_LANES
#define CHUNKS (BLOCK / LANES)  /* vectors per block */

/* LANES lanes of 32 bits; u8v_word: their bytes, u8v_code: one byte per lane (the e4m3 codes) */
typedef int32_t i32v __attribute__((vector_size(4 * LANES)));
typedef uint32_t u32v __attribute__((vector_size(4 * LANES)));
typedef float f32v __attribute__((vector_size(4 * LANES)));
typedef uint16_t u16v __attribute__((vector_size(2 * LANES)));
typedef uint8_t u8v_word __attribute__((vector_size(4 * LANES)));
typedef uint8_t u8v_code __attribute__((vector_size(LANES)));

#if LANES == 16
#define LOW_BYTES(v) __builtin_shufflevector(v, v, 0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60)
#define SPLAT(v) {v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}
/* PAIR_k_LO / _HI (a, b): of each k-lane group of a, then of b, its first / last k/2 lanes (the transposed
 * reductions below) */
#define PAIR_16_LO(a, b) __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
#define PAIR_16_HI(a, b) __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31)
#define PAIR_8_LO(a, b) __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
#define PAIR_8_HI(a, b) __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31)
#define PAIR_4_LO(a, b) __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
#define PAIR_4_HI(a, b) __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31)
#define PAIR_2_LO(a, b) __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
#define PAIR_2_HI(a, b) __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31)
#elif LANES == 8
#define LOW_BYTES(v) __builtin_shufflevector(v, v, 0, 4, 8, 12, 16, 20, 24, 28)
#define SPLAT(v) {v, v, v, v, v, v, v, v}
#define PAIR_8_LO(a, b) __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11)
#define PAIR_8_HI(a, b) __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15)
#define PAIR_4_LO(a, b) __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13)
#define PAIR_4_HI(a, b) __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15)
#define PAIR_2_LO(a, b) __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14)
#define PAIR_2_HI(a, b) __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15)
#else
#error "PORTER_LANES must be 8 or 16"
#endif

/* Magnitudes are kept as non-negative int32 (fp32 bits without the sign): signed compares are one
 * instruction on AVX2, unsigned ones are not. */
static inline i32v select(i32v mask, i32v a, i32v b) { return (mask & a) | (~mask & b); }
static inline i32v smax(i32v a, i32v b) { return select(a > b, a, b); }
static inline i32v smin(i32v a, i32v b) { return select(a < b, a, b); }
static inline i32v splat(int32_t v) { return (i32v)SPLAT(v); }
/* Transposed reductions of LANES blocks at once: v[b] holds block b's lanes; lane b of the result is block b's
 * sum (max, min) over its lanes, taken pairwise: lane j with j + LANES/2, then with j + LANES/4, ..., a fixed
 * order (torch's follows its SIMD width). One level pairs vectors 2i and 2i + 1: each k-lane group of both is
 * halved and its halves combined. LANES - 1 combines of two shuffles for LANES blocks, where a tree per block
 * takes log2(LANES) shuffles for each. v is overwritten. */
#define REDUCE_LEVEL(v, n, k, COMBINE) \
    for (int i = 0; i < (n) / 2; i++) v[i] = COMBINE(PAIR_##k##_LO(v[2 * i], v[2 * i + 1]), \
                                                      PAIR_##k##_HI(v[2 * i], v[2 * i + 1]))
#if LANES == 16
#define REDUCE_ALL(v, COMBINE) do { REDUCE_LEVEL(v, 16, 16, COMBINE); REDUCE_LEVEL(v, 8, 8, COMBINE); \
    REDUCE_LEVEL(v, 4, 4, COMBINE); REDUCE_LEVEL(v, 2, 2, COMBINE); } while (0)
#else
#define REDUCE_ALL(v, COMBINE) do { REDUCE_LEVEL(v, 8, 8, COMBINE); REDUCE_LEVEL(v, 4, 4, COMBINE); \
    REDUCE_LEVEL(v, 2, 2, COMBINE); } while (0)
#endif
#define ADD(a, b) ((a) + (b))
static inline f32v blocks_sum(f32v v[LANES]) { REDUCE_ALL(v, ADD); return v[0]; }
static inline i32v blocks_max(i32v v[LANES]) { REDUCE_ALL(v, smax); return v[0]; }
static inline i32v blocks_min(i32v v[LANES]) { REDUCE_ALL(v, smin); return v[0]; }

/* |x| as fp32 bits a (finite, at most 448) -> the e4m3 code without sign; *value: the magnitude it stands
 * for, as fp32 bits. `subnormal`: whether any |x| may lie below 2^-6 (a constant after inlining). */
static inline __attribute__((always_inline)) i32v e4m3_code(i32v a, i32v *value, int subnormal) {
    /* normal (|x| >= 2^-6, exponent field >= 121): round the 23-bit mantissa to 3 bits, to nearest even; a
     * carry runs into the exponent */
    i32v r = a + 0x7FFFF + ((a >> 20) & 1);
    i32v code = (r >> 20) - (120 << 3);
    *value = r & (int32_t)0xFFF00000;
    if (subnormal) {
        /* |x| = m * 2^(e-150) with the implicit bit; in units of 2^-9 that is m >> (141 - e), rounded to
         * nearest even. Shifts of 25 and more give 0 for every m < 2^24, so e is clamped to [110, 120]:
         * the shift stays in [21, 31] (lanes that are normal ignore it) */
        i32v e = a >> 23;
        i32v is_sub = e < 121;
        u32v m = (u32v)((a & 0x7FFFFF) | 0x800000);
        u32v sh = (u32v)(141 - smin(smax(e, splat(110)), splat(120)));
        i32v sub_code = (i32v)((m + (1u << (sh - 1u)) - 1u + ((m >> sh) & 1u)) >> sh);
        f32v sub_value = __builtin_convertvector(sub_code, f32v) * 0.001953125f;  /* * 2^-9, exact */
        *value = select(is_sub, (i32v)sub_value, *value);
        code = select(is_sub, sub_code, code);
    }
    return code;
}

/* The block after its scale: codes into q, and the error pieces accumulated lane by lane (element LANES*c + j
 * goes to lane j). floor: clip |x| to 448 for the code (floor's scales can leave it above; x stays
 * unclipped for the error); subnormal: see e4m3_code. Both are constants after inlining. */
static inline __attribute__((always_inline)) void block_codes(const i32v x[CHUNKS], float mult, int floor,
                                                              int subnormal, uint8_t *q, f32v *ref,
                                                              f32v *err, i32v *dmax) {
    for (int c = 0; c < CHUNKS; c++) {
        f32v w = (f32v)x[c];
        i32v u = (i32v)(w * mult);  /* exact power-of-two scaling */
        i32v a = u & 0x7FFFFFFF;
        i32v value;
        i32v code = e4m3_code(floor ? smin(a, splat(0x43E00000)) : a, &value, subnormal);
        code |= (u >> 24) & 0x80;  /* the sign */
        u8v_word code_bytes = (u8v_word)code;
        u8v_code code8 = LOW_BYTES(code_bytes);
        memcpy(q + LANES * c, &code8, LANES);
        f32v d = (f32v)a - (f32v)value;  /* |x| - |q|: the error up to its sign, exact in fp32 */
        *ref += w * w;
        *err += d * d;
        *dmax = smax(*dmax, (i32v)d & 0x7FFFFFFF);  /* |d| as bits: non-negative floats order as ints */
    }
}

/* A block's magnitudes as fp32 bits: *hi / *lo get the lane-wise max / min over its CHUNKS vectors (finite
 * magnitudes order as their bits; NaN and Inf above them all). */
static inline void block_extremes(const i32v x[CHUNKS], i32v *hi, i32v *lo) {
    *hi = x[0] & 0x7FFFFFFF;
    *lo = *hi;
    for (int c = 1; c < CHUNKS; c++) {
        i32v a = x[c] & 0x7FFFFFFF;
        *hi = smax(*hi, a);
        *lo = smin(*lo, a);
    }
}

/* A finite block (amax_bits below 0x7F800000) with its amax and amin as fp32 bits: the scale byte, 32 codes, and
 * its error pieces lane by lane into *ref, *err, *dmax (see block_codes). */
static inline void block_scaled(const i32v x[CHUNKS], int32_t amax_bits, int32_t amin_bits, int floor, uint8_t *q,
                                uint8_t *scale, f32v *ref, f32v *err, i32v *dmax) {
    uint32_t k = (uint32_t)(floor ? amax_bits : amax_bits + 0x1FFFFF) >> 23;
    uint32_t byte = k > 8u ? k - 8u : 0u;
    *scale = (uint8_t)byte;
    uint32_t mult_bits = (254u - byte) << 23;  /* 2^(127 - byte): exponent field in [7, 254] */
    float mult, amin;
    memcpy(&mult, &mult_bits, 4);
    memcpy(&amin, &amin_bits, 4);
    int subnormal = amin * mult < 0.015625f;  /* some |x| below 2^-6: the slower rounding for the block */
    if (floor) {
        if (subnormal) block_codes(x, mult, 1, 1, q, ref, err, dmax);
        else block_codes(x, mult, 1, 0, q, ref, err, dmax);
    } else {
        if (subnormal) block_codes(x, mult, 0, 1, q, ref, err, dmax);
        else block_codes(x, mult, 0, 0, q, ref, err, dmax);
    }
}

static inline void load_block(const void *w, int is_bf16, int64_t b, i32v x[CHUNKS]) {
    for (int c = 0; c < CHUNKS; c++) {
        if (is_bf16) {
            u16v h;
            memcpy(&h, (const uint16_t *)w + b * BLOCK + LANES * c, 2 * LANES);
            x[c] = __builtin_convertvector(h, i32v) << 16;  /* bf16 -> fp32 bits, exact */
        } else {
            memcpy(&x[c], (const float *)w + b * BLOCK + LANES * c, 4 * LANES);
        }
    }
}

/* LANES blocks from block b0 on -> their codes, scale bytes and (stats != 0) per block ||w||^2, ||x - q||^2 and
 * max |x - q|, with their extremes and statistics reduced for all of them at once. Returns the number of blocks
 * holding a NaN or an infinity (nothing of those is written). */
static inline int64_t quantize_group(const void *w, int is_bf16, int64_t b0, int floor, uint8_t *q,
                                     uint8_t *scale, float *stats) {
    i32v x[LANES][CHUNKS], hi[LANES], lo[LANES];
    for (int b = 0; b < LANES; b++) {
        load_block(w, is_bf16, b0 + b, x[b]);
        block_extremes(x[b], &hi[b], &lo[b]);
    }
    i32v amax = blocks_max(hi), amin = blocks_min(lo);  /* lane b: block b */
    f32v ref[LANES], err[LANES];
    i32v dmax[LANES];
    int64_t bad = 0;
    for (int b = 0; b < LANES; b++) {
        ref[b] = (f32v){0};
        err[b] = (f32v){0};
        dmax[b] = (i32v){0};
        if (amax[b] >= 0x7F800000) {
            bad++;
            continue;
        }
        block_scaled(x[b], amax[b], amin[b], floor, q + (b0 + b) * BLOCK, scale + b0 + b, &ref[b], &err[b],
                     &dmax[b]);
    }
    if (stats) {
        f32v ref_sum = blocks_sum(ref), err_sum = blocks_sum(err);
        i32v dmax_all = blocks_max(dmax);
        for (int b = 0; b < LANES; b++) {
            if (amax[b] >= 0x7F800000) continue;
            float *stats3 = stats + 3 * (b0 + b);
            stats3[0] = ref_sum[b];
            stats3[1] = err_sum[b];
            int32_t m = dmax_all[b];
            memcpy(&stats3[2], &m, 4);
        }
    }
    return bad;
}

/* w: nb blocks of 32 values, fp32 (is_bf16 == 0) or bf16 bits (is_bf16 == 1), contiguous.
 * q: nb*32 e4m3 codes; scale: nb bytes; stats: nb*3 floats (||w||^2, ||x-q||^2, max |x-q| per block) or NULL.
 * Returns the number of blocks holding a NaN or an infinity (their outputs are not written in full). */
int64_t porter_mxfp8_quantize(const void *w, int is_bf16, int64_t nb, int floor_rounding,
                              uint8_t *q, uint8_t *scale, float *stats) {
    int64_t bad = 0, b = 0;
    for (; b + LANES <= nb; b += LANES)
        bad += quantize_group(w, is_bf16, b, floor_rounding, q, scale, stats);
    int64_t rest = nb - b;
    if (rest) {  /* the last blocks, padded with all-zero blocks to a whole group in local buffers */
        size_t elem = is_bf16 ? 2 : 4;
        uint8_t w_pad[LANES * BLOCK * 4] = {0}, q_pad[LANES * BLOCK] = {0}, scale_pad[LANES] = {0};
        float stats_pad[3 * LANES] = {0};
        memcpy(w_pad, (const uint8_t *)w + b * BLOCK * elem, rest * BLOCK * elem);
        bad += quantize_group(w_pad, is_bf16, 0, floor_rounding, q_pad, scale_pad, stats ? stats_pad : 0);
        memcpy(q + b * BLOCK, q_pad, rest * BLOCK);
        memcpy(scale + b, scale_pad, rest);
        if (stats) memcpy(stats + 3 * b, stats_pad, 3 * rest * sizeof(float));
    }
    return bad;
}

/* Block-FP8 dequantization, porter.format.mxfp8.dequantize_fp8_block's rule for bf16 output:
 * out[r, c] = bf16(value(q[r, c]) * scale[r / bn, c / bk]), the fp32 product rounded to nearest even (a NaN
 * product becomes bf16's quiet NaN of its sign). q: `mats` matrices [rows, cols] of e4m3 codes, contiguous;
 * scale: per matrix [ceil(rows / bn), ceil(cols / bk)] fp32; out: bf16 bits, q's shape. One table lookup,
 * one multiply and one rounding per value, in the order the torch ops do them, so the bytes are theirs. */
static float e4m3_value[256];
static int e4m3_ready;

static void e4m3_table(void) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float v;
        if (e == 15 && m == 7) {
            uint32_t nan = 0x7FC00000u;
            memcpy(&v, &nan, 4);
        } else if (e == 0) {
            v = (float)m / 512.0f;  /* subnormal: m * 2^-9, exact */
        } else {
            uint32_t bits = ((uint32_t)(e - 7 + 127) << 23) | ((uint32_t)m << 20);
            memcpy(&v, &bits, 4);
        }
        e4m3_value[c] = (c & 0x80) ? -v : v;
    }
    e4m3_ready = 1;
}

static inline uint16_t bf16_rne(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);  /* NaN: quiet */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

void porter_fp8_block_dequantize_bf16(const uint8_t *q, const float *scale, int64_t mats, int64_t rows,
                                      int64_t cols, int64_t bn, int64_t bk, uint16_t *out) {
    if (!e4m3_ready) e4m3_table();  /* idempotent: concurrent first calls write the same values */
    int64_t sr = (rows + bn - 1) / bn, sc = (cols + bk - 1) / bk;
    for (int64_t m = 0; m < mats; m++) {
        const float *s = scale + m * sr * sc;
        for (int64_t r = 0; r < rows; r++) {
            const float *srow = s + (r / bn) * sc;
            const uint8_t *qr = q + (m * rows + r) * cols;
            uint16_t *o = out + (m * rows + r) * cols;
            for (int64_t c0 = 0; c0 < cols; c0 += bk) {
                float f = srow[c0 / bk];
                int64_t end = c0 + bk < cols ? c0 + bk : cols;
                for (int64_t c = c0; c < end; c++) o[c] = bf16_rne(e4m3_value[qr[c]] * f);
            }
        }
    }
}
