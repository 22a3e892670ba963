/* The CPU backend's kernels, compiled ahead of time: the statistics pass of
 * analysis/kernels/kernel.py, the eigenvalues of analysis/kernels/eigen.py, the float16 conversion of
 * analysis/kernels/halves.py, the attention pass of analysis/kernels/attention.py and the min-max
 * quantization of analysis/attention/compression.py's what-ifs (the docstrings there
 * and in analysis/kernels/native.py are the definitions; the numpy reference, analysis/kernels/reference.py
 * and analysis/stats/catalogue.py, is the oracle the tests hold these to). Built at install time; where
 * no C compiler is there, the numpy reference runs instead.
 *
 * Plain C99 with no Python API in the kernels: the wrapper (analysis/kernels/native.py) calls them
 * through ctypes, which releases the interpreter's lock for the call, so threads run them at once.
 * Arrays are C-contiguous; the wrapper checks their types and shapes.
 *
 * Floating point:
 * - float64 sums (row pass, Gram reduction): reductions over channels vectorize through
 *   ``#pragma omp simd reduction`` (built with -fopenmp-simd, no OpenMP runtime): lanes of
 *   partial sums; results move by ~1e-15 relative from a sum in order.
 * - the quantization pass: float32 arithmetic in the definition's order, no contraction into
 *   fused multiply-adds (built with -ffp-contract=off), so its errors equal the numpy
 *   definition's level for level.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Flags and scalar slots: analysis/kernels/kernel.py's NORMS ... QUANT and NORM_SUM ... */
enum { NORMS, CHANNELS, ROPE, MEAN, QUANT };
enum { NORM_SUM, SQUARE_SUM, NORM_MIN, NORM_MAX, FIRST_NORM_SUM, FIRST_COUNT };

#define BLOCK 4
#define GUESS_SHIFT 45
#define ABS_MASK 0x7FFFFFFF

#if defined(_MSC_VER)
#define RESTRICT __restrict
#define EXPORT __declspec(dllexport)
#else
#define RESTRICT __restrict__
#define EXPORT __attribute__((visibility("default")))
#endif

/* Each function marked KERNEL is compiled for the baseline and for AVX2 and AVX-512, picked
 * once at load by the CPU (an ELF ifunc), every helper inlined into each clone (`INLINE`: GCC
 * and clang take no other attribute beside target_clones), and exported through a plain
 * wrapper: the baseline's 16-byte vectors run the row pass at half the speed of code compiled
 * for the host. A library built here still runs on any x86-64 (and on arm64: NEON is
 * its baseline). */
#if defined(__x86_64__) && defined(__ELF__) && defined(__clang__) && __clang_major__ >= 14
/* clang 14's resolver never picked its arch=x86-64-v3/v4 clones here (baseline speed): features */
#define KERNEL __attribute__((target_clones("avx512f", "avx2", "default")))
#elif defined(__x86_64__) && defined(__ELF__) && !defined(__clang__) && __GNUC__ >= 12
/* GCC's avx512f clone alone lacks AVX-512BW/VL, which the float16 conversion wants (2.3x) */
#define KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KERNEL
#endif
#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

#define PRAGMA(x) _Pragma(#x)
#define SIMD_REDUCE(op, var) PRAGMA(omp simd reduction(op : var))
#if defined(__clang__) /* clang does not vectorize a float min/max as asked, and warns */
#define SIMD_MINMAX(op, var)
#else
#define SIMD_MINMAX(op, var) SIMD_REDUCE(op, var)
#endif

static inline int64_t bits_of_double(double v) {
    int64_t b;
    memcpy(&b, &v, sizeof b);
    return b;
}

/* order_key: an int32 key of a float32's bits that orders as the float does. */
static inline int32_t order_key(int32_t bits) { return bits ^ ((bits >> 31) & 0x7FFFFFFF); }

/* rint for 0 <= x < 2^22 (and NaN, inf kept), round half to even under the default rounding
 * mode, as ``np.rint``: adding 1.5 * 2^23 leaves no fraction bits. A level ``d * (1/step)`` is
 * in [0, 2^bits] (or NaN/inf when a step underflows): inside that range. Unlike ``rintf`` it
 * needs no SSE4.1 to vectorize. volatile-free: without -ffast-math the compiler keeps it. */
static inline float round_level(float x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (x + magic) - magic;
}

/* hist_bins: count each value (>= 0, NaN or inf) in its log histogram bin, exactly as
 * catalogue.hist_index bins it, without a logarithm: a first guess from the float's top bits
 * (kernel.hist_guesses), then the bin's edges step it to the right bin. NaN and inf: bin 0. */
INLINE void hist_bins(const double *RESTRICT values, int64_t n, const double *RESTRICT edges,
                      const int64_t *RESTRICT guesses, int64_t cells, int64_t bins,
                      int64_t *RESTRICT hist) {
    int64_t first = bits_of_double(edges[1]) >> GUESS_SHIFT;
    for (int64_t i = 0; i < n; i++) {
        double v = values[i];
        if (!(v < INFINITY)) { /* NaN, inf */
            hist[0] += 1;
            continue;
        }
        int64_t cell = (bits_of_double(v) >> GUESS_SHIFT) - first;
        int64_t k = guesses[cell < 0 ? 0 : (cell >= cells ? cells - 1 : cell)];
        k += (v >= edges[k + 1]);
        while (k > 0 && v < edges[k]) k--;
        while (k < bins - 1 && v >= edges[k + 1]) k++;
        hist[k] += 1;
    }
}

typedef struct {
    const float *x;
    const int32_t *bits;
    int64_t dim;
    const int64_t *first;
    const int64_t *second;
    int64_t pairs;
    const int64_t *flags;
    double *scalars;
    double *power; /* (4, dim) */
    int32_t *absmax_bits;
    double *unit_sum;
    double *band;
    int32_t *peak_bits;
    double *square_norms;
    int32_t *low_keys;
    int32_t *high_keys;
    double *rows; /* (BLOCK + 1, max(dim, BLOCK)) */
    double *sums;
} RowPass;

/* row_pass: rows start:stop; returns 1 when every value was finite. */
INLINE int row_pass(const RowPass *p, int64_t start, int64_t stop) {
    const int64_t dim = p->dim;
    const int64_t width = dim > BLOCK ? dim : BLOCK;
    double *RESTRICT power1 = p->power + dim;
    double *RESTRICT power2 = p->power + 2 * dim;
    double *RESTRICT power3 = p->power + 3 * dim;
    double *RESTRICT r0 = p->rows;
    double *RESTRICT r1 = p->rows + width;
    double *RESTRICT r2 = p->rows + 2 * width;
    double *RESTRICT r3 = p->rows + 3 * width;
    double *RESTRICT inverse = p->rows + BLOCK * width;
    int32_t *RESTRICT low_keys = p->low_keys;
    int32_t *RESTRICT high_keys = p->high_keys;
    const int64_t *flags = p->flags;
    double *scalars = p->scalars;
    int finite = 1;
    if (flags[QUANT]) {
        const int32_t *RESTRICT b = p->bits + start * dim;
        for (int64_t j = 0; j < dim; j++) {
            int32_t key = order_key(b[j]);
            low_keys[j] = key;
            high_keys[j] = key;
        }
    }
    for (int64_t block = start; block < stop; block += BLOCK) {
        int64_t count = stop - block < BLOCK ? stop - block : BLOCK;
        for (int64_t k = 0; k < BLOCK; k++) {
            double *RESTRICT row = p->rows + k * width;
            if (k >= count) { /* a short last block: zero rows add nothing to any sum */
                for (int64_t j = 0; j < dim; j++) row[j] = 0.0;
                inverse[k] = 0.0;
                continue;
            }
            int64_t i = block + k;
            const float *RESTRICT values = p->x + i * dim;
            const int32_t *RESTRICT row_bits = p->bits + i * dim;
            double square_sum = 0.0;
            int32_t peak = 0;
            SIMD_REDUCE(+, square_sum)
            for (int64_t j = 0; j < dim; j++) {
                double v = (double)values[j];
                row[j] = v;
                square_sum += v * v;
            }
            SIMD_REDUCE(max, peak)
            for (int64_t j = 0; j < dim; j++) {
                int32_t a = row_bits[j] & ABS_MASK;
                peak = a > peak ? a : peak;
            }
            if (!isfinite(square_sum)) finite = 0;
            scalars[SQUARE_SUM] += square_sum;
            p->square_norms[i] = square_sum;
            if (flags[QUANT]) {
                for (int64_t j = 0; j < dim; j++) {
                    int32_t key = order_key(row_bits[j]);
                    int32_t low = low_keys[j];
                    low_keys[j] = key < low ? key : low;
                }
                for (int64_t j = 0; j < dim; j++) {
                    int32_t key = order_key(row_bits[j]);
                    int32_t high = high_keys[j];
                    high_keys[j] = key > high ? key : high;
                }
            }
            if (flags[CHANNELS]) p->peak_bits[i] = peak;
            if (flags[NORMS]) {
                double norm = sqrt(square_sum);
                scalars[NORM_SUM] += norm;
                scalars[NORM_MIN] = norm < scalars[NORM_MIN] ? norm : scalars[NORM_MIN];
                scalars[NORM_MAX] = norm > scalars[NORM_MAX] ? norm : scalars[NORM_MAX];
                inverse[k] = 1.0 / (1e-30 > norm ? 1e-30 : norm); /* Python's max(norm, 1e-30) */
            }
        }
        if (flags[MEAN]) {
            double *RESTRICT sums = p->sums;
            for (int64_t j = 0; j < dim; j++) sums[j] += (r0[j] + r1[j]) + (r2[j] + r3[j]);
        }
        if (flags[CHANNELS]) {
            int64_t last = block + count - 1; /* a short block repeats its last row */
            const int32_t *RESTRICT b0 = p->bits + block * dim;
            const int32_t *RESTRICT b1 = p->bits + (block + 1 < last ? block + 1 : last) * dim;
            const int32_t *RESTRICT b2 = p->bits + (block + 2 < last ? block + 2 : last) * dim;
            const int32_t *RESTRICT b3 = p->bits + (block + 3 < last ? block + 3 : last) * dim;
            int32_t *RESTRICT absmax = p->absmax_bits;
            for (int64_t j = 0; j < dim; j++) {
                int32_t a = b0[j] & ABS_MASK, b = b1[j] & ABS_MASK;
                int32_t c = b2[j] & ABS_MASK, d = b3[j] & ABS_MASK;
                a = b > a ? b : a;
                c = d > c ? d : c;
                a = c > a ? c : a;
                int32_t m = absmax[j];
                absmax[j] = a > m ? a : m;
            }
            for (int64_t j = 0; j < dim; j++) {
                double a = r0[j], b = r1[j], c = r2[j], d = r3[j];
                power1[j] += (a * a + b * b) + (c * c + d * d);
            }
            for (int64_t j = 0; j < dim; j++) {
                double a = r0[j], b = r1[j], c = r2[j], d = r3[j];
                power2[j] += (a * a * a + b * b * b) + (c * c * c + d * d * d);
            }
            for (int64_t j = 0; j < dim; j++) {
                double a = r0[j] * r0[j], b = r1[j] * r1[j], c = r2[j] * r2[j], d = r3[j] * r3[j];
                power3[j] += (a * a + b * b) + (c * c + d * d);
            }
        }
        if (flags[ROPE]) {
            for (int64_t q = 0; q < p->pairs; q++) {
                int64_t f = p->first[q], s = p->second[q];
                p->band[q] += ((r0[f] * r0[f] + r0[s] * r0[s]) + (r1[f] * r1[f] + r1[s] * r1[s])) +
                              ((r2[f] * r2[f] + r2[s] * r2[s]) + (r3[f] * r3[f] + r3[s] * r3[s]));
            }
        }
        if (flags[NORMS]) {
            double i0 = inverse[0], i1 = inverse[1], i2 = inverse[2], i3 = inverse[3];
            double *RESTRICT unit_sum = p->unit_sum;
            for (int64_t j = 0; j < dim; j++)
                unit_sum[j] += (r0[j] * i0 + r1[j] * i1) + (r2[j] * i2 + r3[j] * i3);
        }
    }
    return finite;
}

/* One row's squared errors at the three widths, per channel (each channel its own low, steps and
 * reciprocals) into c0..c2 (dim,). A function of its own: with its arguments `restrict`, the
 * compiler vectorizes the loop. */
INLINE void channel_errors_of(const float *RESTRICT row, int64_t dim, const float *RESTRICT lows,
                              const float *RESTRICT s0, const float *RESTRICT s1,
                              const float *RESTRICT s2, const float *RESTRICT i0,
                              const float *RESTRICT i1, const float *RESTRICT i2,
                              float *RESTRICT c0, float *RESTRICT c1, float *RESTRICT c2) {
    for (int64_t j = 0; j < dim; j++) {
        float v = row[j], low = lows[j];
        float d = v - low;
        float e0 = (round_level(d * i0[j]) * s0[j] + low) - v;
        float e1 = (round_level(d * i1[j]) * s1[j] + low) - v;
        float e2 = (round_level(d * i2[j]) * s2[j] + low) - v;
        c0[j] += e0 * e0;
        c1[j] += e1 * e1;
        c2[j] += e2 * e2;
    }
}

/* One token group's squared errors (size values sharing one low, steps and reciprocals) into
 * a0..a2 (size,). */
INLINE void token_errors_of(const float *RESTRICT values, int64_t size, float low, float st0,
                            float st1, float st2, float in0, float in1, float in2,
                            float *RESTRICT a0, float *RESTRICT a1, float *RESTRICT a2) {
    for (int64_t j = 0; j < size; j++) {
        float v = values[j];
        float d = v - low;
        float e0 = (round_level(d * in0) * st0 + low) - v;
        float e1 = (round_level(d * in1) * st1 + low) - v;
        float e2 = (round_level(d * in2) * st2 + low) - v;
        a0[j] += e0 * e0;
        a1[j] += e1 * e1;
        a2[j] += e2 * e2;
    }
}

/* quant_tile. scratch: (14, dim) float32; groups: (8, group * ceil(dim / group)). */
INLINE void quant_tile(const float *RESTRICT x, int64_t dim, int64_t group, int64_t start,
                       int64_t stop, const int32_t *RESTRICT low_keys,
                       const int32_t *RESTRICT high_keys, const float *levels,
                       double *RESTRICT token, double *RESTRICT channel, float *RESTRICT scratch,
                       float *RESTRICT groups, int64_t groups_width) {
    const float one = 1.0f;
    float *RESTRICT lows = scratch;
    float *RESTRICT highs = scratch + dim;
    for (int64_t j = 0; j < dim; j++) {
        int32_t low = order_key(low_keys[j]), high = order_key(high_keys[j]);
        memcpy(lows + j, &low, sizeof low);
        memcpy(highs + j, &high, sizeof high);
    }
    float *steps = scratch + 2 * dim;    /* (3, dim) */
    float *inverses = scratch + 5 * dim; /* (3, dim) */
    float *channel_errors = scratch + 8 * dim;
    float *token_errors = scratch + 11 * dim;
    for (int b = 0; b < 3; b++) {
        float level = levels[b];
        float *RESTRICT step_b = steps + b * dim;
        float *RESTRICT inverse_b = inverses + b * dim;
        for (int64_t j = 0; j < dim; j++) {
            float spread = highs[j] - lows[j];
            float step = spread / level; /* unconditional: a select, not a branch, vectorizes */
            step = spread > 0 ? step : one;
            step_b[j] = step;
            inverse_b[j] = one / step;
        }
    }
    memset(channel_errors, 0, 3 * dim * sizeof(float));
    memset(token_errors, 0, 3 * dim * sizeof(float));
    const float *RESTRICT s0 = steps, *RESTRICT s1 = steps + dim, *RESTRICT s2 = steps + 2 * dim;
    const float *RESTRICT i0 = inverses, *RESTRICT i1 = inverses + dim,
                *RESTRICT i2 = inverses + 2 * dim;
    float *RESTRICT c0 = channel_errors, *RESTRICT c1 = channel_errors + dim,
          *RESTRICT c2 = channel_errors + 2 * dim;
    float *RESTRICT t0 = token_errors, *RESTRICT t1 = token_errors + dim,
          *RESTRICT t2 = token_errors + 2 * dim;
    const float l0 = levels[0], l1 = levels[1], l2 = levels[2];
    const int64_t full = dim - dim % group;
    const int64_t per_row = (dim + group - 1) / group;
    float *RESTRICT group_low = groups, *RESTRICT group_high = groups + groups_width;
    float *RESTRICT step0 = groups + 2 * groups_width, *RESTRICT step1 = groups + 3 * groups_width,
          *RESTRICT step2 = groups + 4 * groups_width;
    float *RESTRICT inverse0 = groups + 5 * groups_width,
          *RESTRICT inverse1 = groups + 6 * groups_width,
          *RESTRICT inverse2 = groups + 7 * groups_width;
    for (int64_t i = start; i < stop; i++) {
        const float *RESTRICT row = x + i * dim;
        for (int64_t g = 0; g < dim; g += group) {
            int64_t size = g < full ? group : dim - full;
            const float *RESTRICT values = row + g;
            float low = values[0], high = values[0];
            /* finite values only (the tile passed the row pass): min and max in any order */
            SIMD_MINMAX(min, low)
            for (int64_t j = 0; j < size; j++) low = values[j] < low ? values[j] : low;
            SIMD_MINMAX(max, high)
            for (int64_t j = 0; j < size; j++) high = values[j] > high ? values[j] : high;
            int64_t q = (i - start) * per_row + g / group;
            group_low[q] = low;
            group_high[q] = high;
        }
    }
    for (int64_t q = 0; q < (stop - start) * per_row; q++) {
        float spread = group_high[q] - group_low[q];
        int positive = spread > 0;
        float step = spread / l0;
        step = positive ? step : one;
        step0[q] = step;
        inverse0[q] = one / step;
        step = spread / l1;
        step = positive ? step : one;
        step1[q] = step;
        inverse1[q] = one / step;
        step = spread / l2;
        step = positive ? step : one;
        step2[q] = step;
        inverse2[q] = one / step;
    }
    for (int64_t i = start; i < stop; i++) {
        const float *row = x + i * dim;
        channel_errors_of(row, dim, lows, s0, s1, s2, i0, i1, i2, c0, c1, c2);
        for (int64_t g = 0; g < dim; g += group) {
            int64_t q = (i - start) * per_row + g / group;
            token_errors_of(row + g, g < full ? group : dim - full, group_low[q], step0[q],
                            step1[q], step2[q], inverse0[q], inverse1[q], inverse2[q], t0 + g,
                            t1 + g, t2 + g);
        }
    }
    for (int b = 0; b < 3; b++) {
        double total = 0.0;
        for (int64_t j = 0; j < dim; j++) total += (double)channel_errors[b * dim + j];
        channel[b] += total;
        total = 0.0;
        for (int64_t j = 0; j < dim; j++) total += (double)token_errors[b * dim + j];
        token[b] += total;
    }
}

/* What one kvsnap_accumulate call reads and adds into, as three structs (field per line:
 * analysis/kernels/native.py declares the same layouts with ctypes, and tests/analysis/kernels/test_native.py
 * compares the two field by field). */

/* Piece: one call's rows and what it writes for each. */
typedef struct {
    const float *x;           /* (n, dim) float32, also read as its int32 bits */
    int64_t n;                /* rows */
    int64_t dim;              /* channels */
    const int64_t *positions; /* (n,) each row's position */
    int32_t *peak_bits;       /* (n,) out: each row's max |x| as float32 bits */
    double *square_norms;     /* (n,) out: each row's ||x||^2 */
    double *channel_sums;     /* (dim,) out: this piece's channel sums (zeroed by the caller) */
} Piece;

/* Settings: what stays fixed over an accumulator's pieces. */
typedef struct {
    const int64_t *first;   /* (pairs,) RoPE pairs: first channel */
    const int64_t *second;  /* (pairs,) second channel */
    int64_t pairs;          /* RoPE pairs */
    const int64_t *levels;  /* (3,) quantization levels at 8, 4, 2 bits */
    const int64_t *flags;   /* (5,) the groups: NORMS, CHANNELS, ROPE, MEAN, QUANT */
    const double *edges;    /* (bins + 1,) histogram edges */
    int64_t bins;           /* histogram bins */
    const int64_t *guesses; /* (cells,) a first bin for each top-bits cell */
    int64_t cells;          /* cells of guesses */
    int64_t group;          /* quantization group: rows per tile, channels per token group */
} Settings;

/* RunningSums: one accumulator's running sums (analysis/stats/sums.py's RunningSums), which the
 * call adds into: two counts, the call's scalars and channel maxima, then the catalogue's sums
 * the kernel adds into in place, each named and typed as analysis/stats/catalogue.py's SUMS
 * declares it, in the order of analysis/kernels/native.py's KERNEL_SUMS. */
typedef struct {
    int64_t dim;             /* channels */
    int64_t position_bins;   /* bins of position_count and position_norm */
    double *scalars;         /* (6,) NORM_SUM ... FIRST_COUNT */
    int32_t *absmax_bits;    /* (dim,) each channel's max |x| as float32 bits */
    int64_t *norm_hist;      /* (bins,) */
    int64_t *peak_hist;      /* (bins,) */
    double *power;           /* (4, dim) sums of x, x^2, x^3, x^4 */
    double *unit_sum;        /* (dim,) */
    double *band;            /* (pairs,) RoPE pair energy; unread without the ROPE flag */
    int64_t *position_count; /* (position_bins,) */
    double *position_norm;   /* (position_bins,) */
    double *quant_token;     /* (3,) per-token quantization error sums at 8, 4, 2 bits */
    double *quant_channel;   /* (3,) per-channel ones */
} RunningSums;

/* accumulate (exported below as kvsnap_accumulate). Returns 0; -1 when its work space could
 * not be allocated, -2 when the piece's channels are not the sums' (nothing was added then). */
KERNEL static int accumulate(const Piece *piece, const Settings *settings, RunningSums *running) {
    if (piece->dim != running->dim) return -2;
    const float *x = piece->x;
    const int64_t n = piece->n, dim = piece->dim;
    const int64_t *positions = piece->positions;
    int32_t *peak_bits = piece->peak_bits;
    double *square_norms = piece->square_norms, *sums = piece->channel_sums;
    const int64_t *first = settings->first, *second = settings->second;
    const int64_t pairs = settings->pairs;
    const int64_t *levels = settings->levels, *flags = settings->flags;
    const double *edges = settings->edges;
    const int64_t bins = settings->bins, cells = settings->cells, group = settings->group;
    const int64_t *guesses = settings->guesses;
    double *scalars = running->scalars, *power = running->power, *unit_sum = running->unit_sum;
    double *band = running->band, *position_norm = running->position_norm;
    int64_t *norm_hist = running->norm_hist, *peak_hist = running->peak_hist;
    int64_t *position_count = running->position_count;
    const int64_t position_bins = running->position_bins;
    int32_t *absmax_bits = running->absmax_bits;
    double *quant_token = running->quant_token, *quant_channel = running->quant_channel;
    const int64_t width = dim > BLOCK ? dim : BLOCK;
    const int64_t groups_width = group * ((dim + group - 1) / group);
    double *rows = malloc(sizeof(double) * (BLOCK + 1) * width);
    int32_t *keys = malloc(sizeof(int32_t) * 2 * (dim > 0 ? dim : 1));
    float *scratch = malloc(sizeof(float) * 14 * (dim > 0 ? dim : 1));
    float *groups = malloc(sizeof(float) * 8 * (groups_width > 0 ? groups_width : 1));
    double *values = malloc(sizeof(double) * (n > 0 ? n : 1));
    if (!rows || !keys || !scratch || !groups || !values) {
        free(rows), free(keys), free(scratch), free(groups), free(values);
        return -1;
    }
    const int32_t *bits = (const int32_t *)(const void *)x;
    float levels32[3] = {(float)levels[0], (float)levels[1], (float)levels[2]};
    RowPass p = {x,     bits,        dim,      first,     second,      pairs,
                 flags, scalars,     power,    absmax_bits, unit_sum,  band,
                 peak_bits, square_norms, keys, keys + dim, rows,      sums};
    int nan = 0;
    for (int64_t start = 0; start < n; start += group) {
        int64_t stop = start + group < n ? start + group : n;
        int finite = row_pass(&p, start, stop);
        if (flags[QUANT]) {
            if (finite)
                quant_tile(x, dim, group, start, stop, keys, keys + dim, levels32, quant_token,
                           quant_channel, scratch, groups, groups_width);
            else
                nan = 1;
        }
    }
    if (nan) {
        for (int b = 0; b < 3; b++) quant_token[b] = quant_channel[b] = NAN;
    }
    if (flags[MEAN]) {
        for (int64_t j = 0; j < dim; j++) power[j] += sums[j];
    }
    if (flags[NORMS]) {
        for (int64_t i = 0; i < n; i++) values[i] = sqrt(square_norms[i]);
        hist_bins(values, n, edges, guesses, cells, bins, norm_hist);
        for (int64_t i = 0; i < n; i++) {
            int64_t position = positions[i];
            double norm = values[i];
            int64_t slot = 0;
            if (position > 0) {
                slot = (bits_of_double((double)position) >> 52) - 1023 + 1;
                slot = slot < position_bins - 1 ? slot : position_bins - 1;
            } else if (position == 0) {
                scalars[FIRST_NORM_SUM] += norm;
                scalars[FIRST_COUNT] += 1.0;
            }
            position_count[slot] += 1;
            position_norm[slot] += norm;
        }
    }
    if (flags[CHANNELS]) {
        for (int64_t i = 0; i < n; i++) {
            float peak;
            memcpy(&peak, peak_bits + i, sizeof peak);
            values[i] = (double)peak;
        }
        hist_bins(values, n, edges, guesses, cells, bins, peak_hist);
    }
    free(rows), free(keys), free(scratch), free(groups), free(values);
    return 0;
}

/* top_rows: the indices of the min(k, n) rows with the largest peaks into best (k,);
 * returns how many. */
EXPORT int64_t kvsnap_top_rows(const int32_t *peak_bits, int64_t n, int64_t k, int64_t *best) {
    int64_t m = k < n ? k : n;
    if (m <= 0) return 0;
    int64_t lowest = 0;
    for (int64_t i = 0; i < m; i++) {
        best[i] = i;
        if (peak_bits[i] <= peak_bits[best[lowest]]) lowest = i;
    }
    int32_t floor = peak_bits[best[lowest]];
    for (int64_t i = m; i < n; i++) {
        if (peak_bits[i] >= floor) { /* ties: the later row ranks higher */
            best[lowest] = i;
            lowest = 0;
            for (int64_t s = 1; s < m; s++) {
                int32_t a = peak_bits[best[s]], b = peak_bits[best[lowest]];
                if (a < b || (a == b && best[s] < best[lowest])) lowest = s;
            }
            floor = peak_bits[best[lowest]];
        }
    }
    return m;
}

/* add_shift_terms: gram (dim, dim) += c s^T + s c^T - n c c^T. */
EXPORT void kvsnap_add_shift_terms(double *gram, int64_t dim, const float *center,
                                   const double *sums, int64_t n) {
    for (int64_t i = 0; i < dim; i++) {
        double ci = (double)center[i];
        double *RESTRICT row = gram + i * dim;
        for (int64_t j = 0; j < dim; j++) {
            double cj = (double)center[j];
            row[j] += ci * sums[j] + sums[i] * cj - (double)n * ci * cj;
        }
    }
}

/* convert: float16 bits (n,) to float32 (n,) (exported below). */
KERNEL static void halves_to_float32(const uint16_t *RESTRICT halves, int64_t n,
                                     uint32_t *RESTRICT out) {
    uint32_t subnormal = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t h = halves[i];
        uint32_t magnitude = h & 0x7FFFu;
        uint32_t sign = (h & 0x8000u) << 16;
        uint32_t normal = (magnitude << 13) + 0x38000000u;
        uint32_t special = 0x7F800000u | ((magnitude & 0x3FFu) << 13);
        uint32_t value = magnitude >= 0x7C00u ? special : (magnitude >= 0x400u ? normal : 0u);
        subnormal |= (uint32_t)(magnitude - 1u < 0x3FFu);
        out[i] = sign | value;
    }
    if (subnormal) {
        const float scale = 5.9604644775390625e-08f; /* 2^-24 */
        for (int64_t i = 0; i < n; i++) {
            uint32_t h = halves[i];
            uint32_t magnitude = h & 0x7FFFu;
            if (magnitude != 0 && magnitude < 0x400u) {
                float f = (float)magnitude * scale;
                if (h & 0x8000u) f = -f;
                memcpy(out + i, &f, sizeof f);
            }
        }
    }
}

/* The Householder reflector of step i (row i of a, its first i entries; i >= 1): row i scaled by
 * the sum of its magnitudes and its last entry shifted, e[i] set to the sub-diagonal. Returns
 * h (the reflector's norm: the update's divisor), 0 where the step has no update (i == 1, or the
 * row already zero): e[i] is then the row's last entry. */
INLINE double reflector(double *RESTRICT ai, int64_t i, double *RESTRICT e) {
    int64_t last = i - 1;
    if (last == 0) {
        e[i] = ai[last];
        return 0.0;
    }
    double scale = 0.0, h = 0.0;
    SIMD_REDUCE(+, scale)
    for (int64_t k = 0; k <= last; k++) scale += fabs(ai[k]);
    if (scale == 0.0) {
        e[i] = ai[last];
        return 0.0;
    }
    for (int64_t k = 0; k <= last; k++) ai[k] /= scale;
    SIMD_REDUCE(+, h)
    for (int64_t k = 0; k <= last; k++) h += ai[k] * ai[k];
    double f = ai[last];
    double g = f >= 0.0 ? -sqrt(h) : sqrt(h);
    e[i] = scale * g;
    h -= f * g;
    ai[last] = f - g;
    return h;
}

/* p[0..last] := A u / h less its projection (the update's second vector), from the sums
 * p[j] = a[j, 0..last] . u already taken (u = row i, the reflector; ``last`` = i - 1). */
INLINE void finish_vector(double *RESTRICT p, const double *RESTRICT u, int64_t last, double h) {
    double f = 0.0;
    for (int64_t j = 0; j <= last; j++) {
        p[j] /= h;
        f += p[j] * u[j];
    }
    double hh = f / (h + h);
    for (int64_t j = 0; j <= last; j++) p[j] -= hh * u[j];
}

/* p[0..i-1] for the reflector in row i of a (its norm h), from rows 0..i-1 not updated since:
 * the product of a step whose previous step had no update (or the first step), taken alone. */
INLINE void start_vector(const double *RESTRICT a, int64_t n, int64_t i, double h, double *RESTRICT p) {
    const double *RESTRICT u = a + i * n;
    for (int64_t j = 0; j < i; j++) {
        const double *RESTRICT aj = a + j * n;
        double g = 0.0;
        SIMD_REDUCE(+, g)
        for (int64_t k = 0; k < i; k++) g += aj[k] * u[k];
        p[j] = g;
    }
    finish_vector(p, u, i - 1, h);
}

/* tridiagonalize: symmetric a (n, n), overwritten, to diagonal d and sub-diagonal
 * e[1:] (e[0] = 0); work (2n,) scratch. Each step's rank-2 update of a row is fused with the
 * next step's product of that row and the next reflector, so the matrix is read once a step
 * instead of twice (a plain reduction takes two passes): at 128 x 128 it lives in L2, and those
 * reads, not the arithmetic, bound the reduction (0.85x of the two-pass time here; fused
 * multiply-adds changed nothing). The same operations on the same values: the eigenvalues
 * agree with the two-pass reduction's to rounding of the products' sums. */
INLINE void tridiagonalize(double *RESTRICT a, int64_t n, double *RESTRICT d, double *RESTRICT e,
                           double *RESTRICT work) {
    double *p = work, *next = work + n;
    double h = n > 1 ? reflector(a + (n - 1) * n, n - 1, e) : 0.0;
    if (h != 0.0) start_vector(a, n, n - 1, h, p); /* the first step's product, alone */
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t last = i - 1;
        double *RESTRICT ai = a + i * n;
        double next_h = 0.0;
        if (h != 0.0) {
            /* row ``last`` first: the next step's reflector is made from it */
            double *RESTRICT al = a + last * n;
            double fl = ai[last], gl = p[last];
            for (int64_t k = 0; k <= last; k++) al[k] -= fl * p[k] + gl * ai[k];
        }
        if (last > 0) next_h = reflector(a + last * n, last, e);
        if (h != 0.0 && next_h != 0.0) {
            const double *RESTRICT u = a + last * n;
            for (int64_t j = 0; j < last; j++) {
                double *RESTRICT aj = a + j * n;
                double fj = ai[j], gj = p[j], g = 0.0;
                SIMD_REDUCE(+, g)
                for (int64_t k = 0; k < last; k++) {
                    aj[k] -= fj * p[k] + gj * ai[k];
                    g += aj[k] * u[k];
                }
                aj[last] -= fj * p[last] + gj * ai[last];
                next[j] = g;
            }
            finish_vector(next, u, last - 1, next_h);
            double *swap = p;
            p = next;
            next = swap;
        } else if (h != 0.0) {
            for (int64_t j = 0; j < last; j++) {
                double *RESTRICT aj = a + j * n;
                double fj = ai[j], gj = p[j];
                for (int64_t k = 0; k <= last; k++) aj[k] -= fj * p[k] + gj * ai[k];
            }
        } else if (next_h != 0.0) { /* no update this step: the next step's product, alone */
            start_vector(a, n, last, next_h, p);
        }
        h = next_h;
    }
    e[0] = 0.0;
    for (int64_t i = 0; i < n; i++) d[i] = a[i * n + i];
}

/* pair: the eigenvalues of [[a, b], [b, c]] (LAPACK's dlae2). */
INLINE void pair(double a, double b, double c, double *first_out, double *second_out) {
    double total = a + c, difference = fabs(a - c);
    double twice = fabs(b + b);
    double large = fabs(a) > fabs(c) ? a : c, small = fabs(a) > fabs(c) ? c : a;
    double root;
    if (difference > twice) {
        double r = twice / difference;
        root = difference * sqrt(1.0 + r * r);
    } else if (difference < twice) {
        double r = difference / twice;
        root = twice * sqrt(1.0 + r * r);
    } else {
        root = twice * sqrt(2.0);
    }
    if (total == 0.0) {
        *first_out = 0.5 * root;
        *second_out = -0.5 * root;
        return;
    }
    double first = total < 0.0 ? 0.5 * (total - root) : 0.5 * (total + root);
    *first_out = first;
    *second_out = (large / first) * small - (b / first) * b;
}

#define MAX_SWEEPS 30
static const double EPSILON_SQUARED = 1.2325951644078310e-32; /* (2^-53)^2 */
static const double SMALLEST = 2.2250738585072014e-308;

/* One QL chain's state between sweeps (`ql_many`'s locals), so that chains can run at once. */
typedef struct {
    double *d, *e;
    int64_t n, low, m, i, sweeps;
    int converged;
    double c, s, gamma, p, sigma;
} Chain;

/* `ql_many`'s search for the next sweep of ``q``: deflations and 2 x 2 blocks done on the way; 1 with
 * a sweep set up (rotations ``q->i`` down to ``q->low``), 0 when the chain is done (or gave up:
 * ``converged`` 0). */
INLINE int next_sweep(Chain *q) {
    double *RESTRICT d = q->d, *RESTRICT e = q->e;
    const int64_t n = q->n;
    while (q->low < n) {
        int64_t low = q->low, m = low;
        while (m < n - 1 && e[m] > EPSILON_SQUARED * fabs(d[m]) * fabs(d[m + 1]) + SMALLEST) m++;
        if (m < n - 1) e[m] = 0.0;
        if (m == low) {
            q->low += 1;
            continue;
        }
        if (m == low + 1) {
            double first, second;
            pair(d[low], sqrt(e[low]), d[low + 1], &first, &second);
            d[low] = first;
            d[low + 1] = second;
            e[low] = 0.0;
            q->low += 2;
            continue;
        }
        q->sweeps += 1;
        if (q->sweeps > MAX_SWEEPS * n) {
            q->converged = 0;
            return 0;
        }
        double root = sqrt(e[low]);
        double sigma = (d[low + 1] - d[low]) / (2.0 * root);
        double r = sqrt(sigma * sigma + 1.0);
        q->sigma = d[low] - root / (sigma + (sigma >= 0.0 ? r : -r));
        q->c = 1.0;
        q->s = 0.0;
        q->gamma = d[m] - q->sigma;
        q->p = q->gamma * q->gamma;
        q->m = m;
        q->i = m - 1;
        return 1;
    }
    return 0;
}

/* One rotation of a QL sweep at row i, on locals (the same operations, in the same order). */
#define ROTATE(d, e, i, m, c, s, gamma, p, sigma)                  \
    do {                                                           \
        double squared_ = e[i], r_ = p + squared_;                 \
        if (i != m - 1) e[i + 1] = s * r_;                         \
        double previous_c_ = c;                                    \
        c = p / r_;                                                \
        s = squared_ / r_;                                         \
        double previous_gamma_ = gamma, alpha_ = d[i];             \
        gamma = c * (alpha_ - sigma) - s * previous_gamma_;        \
        d[i + 1] = previous_gamma_ + (alpha_ - gamma);             \
        p = c != 0.0 ? (gamma * gamma) / c : previous_c_ * squared_; \
    } while (0)

/* e[i] := the square of the off-diagonal between d[i] and d[i + 1] (e[1:] in, e[n - 1] = 0). */
INLINE void square_off_diagonal(double *e, int64_t n) {
    for (int64_t i = 0; i < n - 1; i++) e[i] = e[i + 1] * e[i + 1];
    e[n - 1] = 0.0;
}

#define QL_CHAINS 4 /* QL iterations interleaved: 8 gains nothing more on 128 x 128 */

/* ``width`` chains' rotations interleaved, each chain mid-sweep: the rotations all have left (the
 * fewest of them), then each chain whose sweep ended is closed and its next sweep set up
 * (``more``: 0 once a chain is done). One chain: the rest of its sweep. */
#define INTERLEAVE(width)                                                                   \
    INLINE void interleave_##width(Chain **q, int *more) {                                  \
        int64_t k = q[0]->i - q[0]->low + 1;                                                \
        for (int w = 1; w < width; w++) {                                                   \
            int64_t left = q[w]->i - q[w]->low + 1;                                         \
            if (left < k) k = left;                                                         \
        }                                                                                   \
        double c[width], s[width], g[width], p[width], sigma[width];                        \
        double *d[width], *e[width];                                                        \
        int64_t i[width], m[width];                                                         \
        for (int w = 0; w < width; w++) {                                                   \
            c[w] = q[w]->c, s[w] = q[w]->s, g[w] = q[w]->gamma, p[w] = q[w]->p;             \
            sigma[w] = q[w]->sigma, d[w] = q[w]->d, e[w] = q[w]->e, i[w] = q[w]->i;         \
            m[w] = q[w]->m;                                                                 \
        }                                                                                   \
        for (int64_t t = 0; t < k; t++) {                                                   \
            _Pragma("GCC unroll 4") for (int w = 0; w < width; w++) {                       \
                ROTATE(d[w], e[w], i[w], m[w], c[w], s[w], g[w], p[w], sigma[w]);           \
                i[w]--;                                                                     \
            }                                                                               \
        }                                                                                   \
        for (int w = 0; w < width; w++) {                                                   \
            Chain *x = q[w];                                                                \
            x->c = c[w], x->s = s[w], x->gamma = g[w], x->p = p[w], x->i = i[w];            \
            if (x->i < x->low) {                                                            \
                x->e[x->low] = x->s * x->p;                                                 \
                x->d[x->low] = x->sigma + x->gamma;                                         \
                more[w] = next_sweep(x);                                                    \
            }                                                                               \
        }                                                                                   \
    }
INTERLEAVE(1)
INTERLEAVE(2)
INTERLEAVE(3)
INTERLEAVE(4)

/* ql on count (<= QL_CHAINS) tridiagonals (d[c], e[c][1:]) at once: the eigenvalues of each
 * into its d (its e destroyed); converged[c] 0 if they took more than MAX_SWEEPS per eigenvalue
 * in all. The root-free QL iteration of LAPACK's dsterf (Pal-Walker-Kahan): it runs on the
 * squared off-diagonal, so a rotation takes two divisions and no square root; a 2 x 2 block
 * that splits off is solved directly. A sweep is a chain of dependent divisions: the chains'
 * rotations are interleaved (`interleave_N`), and four independent chains run in about the
 * time of one (QL's share of a 128 x 128 batch: 0.70x of two chains at a time, here). Each
 * result is bit for bit the tridiagonal's alone. */
INLINE void ql_many(double **d, double **e, int count, int64_t n, int *converged) {
    Chain chains[QL_CHAINS];
    int more[QL_CHAINS];
    for (int c = 0; c < count; c++) {
        Chain q = {d[c], e[c], n, 0, 0, 0, 0, 1, 0.0, 0.0, 0.0, 0.0, 0.0};
        chains[c] = q;
        square_off_diagonal(e[c], n);
        more[c] = next_sweep(&chains[c]);
    }
    for (;;) {
        Chain *active[QL_CHAINS];
        int slot[QL_CHAINS], width = 0;
        for (int c = 0; c < count; c++)
            if (more[c]) active[width] = &chains[c], slot[width++] = c;
        if (width == 0) break;
        int local[QL_CHAINS];
        for (int w = 0; w < width; w++) local[w] = 1;
        if (width == 4) interleave_4(active, local);
        else if (width == 3) interleave_3(active, local);
        else if (width == 2) interleave_2(active, local);
        else interleave_1(active, local);
        for (int w = 0; w < width; w++) more[slot[w]] = local[w];
    }
    for (int c = 0; c < count; c++) converged[c] = chains[c].converged;
}

/* scale_into: matrix (n, n) times a power of two into a, its largest entry in [1, 2);
 * returns the exponent. */
INLINE double scale_into(const double *matrix, int64_t n, double *a) {
    double top = 0.0;
    for (int64_t i = 0; i < n * n; i++) {
        double x = fabs(matrix[i]);
        if (x > top || x != x) top = x; /* a NaN stays: no scaling then, as for an infinity */
    }
    double exponent = 0.0;
    if (top > 0.0 && isfinite(top)) {
        exponent = floor(log2(top));
        exponent = exponent < -1000.0 ? -1000.0 : (exponent > 1000.0 ? 1000.0 : exponent);
    }
    double factor = ldexp(1.0, (int)-exponent);
    for (int64_t i = 0; i < n * n; i++) a[i] = matrix[i] * factor;
    return exponent;
}

/* eigenvalues of each of count symmetric matrices (count, n, n) into out (count, n),
 * unordered, QL_CHAINS at a time (their QL chains interleaved, `ql_many`); converged (count,) 0
 * where one did not converge. work: (n, n) and e: (QL_CHAINS + 2, n) work space. Each matrix's
 * values are bit for bit those of the matrix alone. */
KERNEL static void eigenvalues_batch(const double *matrices, int64_t count, int64_t n, double *out,
                                     double *work, double *e, int32_t *converged) {
    const int64_t size = n * n;
    double *scratch = e + QL_CHAINS * n;
    for (int64_t b = 0; b < count; b += QL_CHAINS) {
        int width = count - b < QL_CHAINS ? (int)(count - b) : QL_CHAINS;
        double *d[QL_CHAINS], *chain_e[QL_CHAINS], exponent[QL_CHAINS];
        int ok[QL_CHAINS];
        for (int w = 0; w < width; w++) { /* one reduction at a time, through one work matrix */
            d[w] = out + (b + w) * n;
            chain_e[w] = e + w * n;
            exponent[w] = scale_into(matrices + (b + w) * size, n, work);
            tridiagonalize(work, n, d[w], chain_e[w], scratch);
        }
        ql_many(d, chain_e, width, n, ok);
        for (int w = 0; w < width; w++) {
            double back = ldexp(1.0, (int)exponent[w]);
            for (int64_t i = 0; i < n; i++) d[w][i] *= back;
            converged[b + w] = ok[w];
        }
    }
}

/* ---- The attention group's pass (analysis/kernels/attention.py): block_scores and its helpers ---- */

/* analysis/kernels/attention.py's row fields and constants */
enum { SINK_FIELD, LOCAL_FIELD, ENTROPY_FIELD, VISIBLE_FIELD, DISTANCE_FIELD, TOP_FIELD,
       KEPT_FIELD, SINK_SHARE_FIELD, INVERSE_FIELD, ROW_FIELDS };
#define ATTENTION_CHUNK 512
static const float MASKED_LOGIT = -3.0e38f;
static const float EXP_FLOOR = -87.33654f;

/* exp: exp(d) in float32 for d <= 0 (Cephes expf: range reduction by ln 2, a
 * degree-6 polynomial, the power of two built from its bits; within 1 ulp), 0 below float32's
 * normal range. Plain arithmetic and selects, so a loop calling it vectorizes. */
static inline float exp_nonpositive(float d) {
    float x = d > EXP_FLOOR ? d : EXP_FLOOR;
    float n = round_level(x * 1.442695041f); /* |x log2 e| < 2^22: the magic rounding holds */
    float r = x - n * 0.693359375f - n * -2.12194440e-4f;
    float poly = 1.9875691500e-4f;
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    float value = poly * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return d >= EXP_FLOOR ? value * scale : 0.0f;
}

/* np.searchsorted(a[:n], v, "left") and "right" on increasing int64 */
static inline int64_t search_left(const int64_t *a, int64_t n, int64_t v) {
    int64_t low = 0, high = n;
    while (low < high) {
        int64_t mid = low + (high - low) / 2;
        if (a[mid] < v) low = mid + 1;
        else high = mid;
    }
    return low;
}

static inline int64_t search_right(const int64_t *a, int64_t n, int64_t v) {
    int64_t low = 0, high = n;
    while (low < high) {
        int64_t mid = low + (high - low) / 2;
        if (a[mid] <= v) low = mid + 1;
        else high = mid;
    }
    return low;
}

/* largest: the largest of top and values[:n] (finite), on order keys */
INLINE float largest_of(const float *RESTRICT values, int64_t n, float top) {
    const int32_t *RESTRICT bits = (const int32_t *)(const void *)values;
    int32_t start;
    memcpy(&start, &top, sizeof start);
    int32_t best = order_key(start);
    SIMD_REDUCE(max, best)
    for (int64_t c = 0; c < n; c++) {
        int32_t key = order_key(bits[c]);
        best = key > best ? key : best;
    }
    best = order_key(best);
    float out;
    memcpy(&out, &best, sizeof out);
    return out;
}

/* first: the index of the first of values[:n] equal to value, else -1 */
INLINE int64_t first_equal(const float *RESTRICT values, int64_t n, float value) {
    for (int64_t start = 0; start < n; start += ATTENTION_CHUNK) {
        int64_t size = n - start < ATTENTION_CHUNK ? n - start : ATTENTION_CHUNK;
        int32_t hits = 0;
        SIMD_REDUCE(+, hits)
        for (int64_t c = 0; c < size; c++) hits += values[start + c] == value;
        if (hits)
            for (int64_t c = 0; c < size; c++)
                if (values[start + c] == value) return start + c;
    }
    return -1;
}

/* exponentials: values[:n] (products) become exp(values * scale - top); adds
 * the sums of e, of e (logit - top) and of e (back - at) to sums[0..2]. float32 within each
 * chunk (vector lanes), float64 across chunks. */
INLINE void exponentials(float *RESTRICT values, int64_t n, float scale, float top, float back,
                         const float *RESTRICT at, double *RESTRICT sums) {
    for (int64_t start = 0; start < n; start += ATTENTION_CHUNK) {
        int64_t size = n - start < ATTENTION_CHUNK ? n - start : ATTENTION_CHUNK;
        float *RESTRICT chunk = values + start;
        const float *RESTRICT where = at + start;
        float total = 0.0f, weighted = 0.0f, moment = 0.0f;
        PRAGMA(omp simd reduction(+ : total, weighted, moment))
        for (int64_t c = 0; c < size; c++) {
            float d = chunk[c] * scale - top;
            float e = exp_nonpositive(d);
            chunk[c] = e;
            total += e;
            weighted += e * d;
            moment += e * (back - where[c]);
        }
        sums[0] += (double)total;
        sums[1] += (double)weighted;
        sums[2] += (double)moment;
    }
}

/* sum */
INLINE double sum_of(const float *RESTRICT values, int64_t n) {
    double total = 0.0;
    SIMD_REDUCE(+, total)
    for (int64_t c = 0; c < n; c++) total += (double)values[c];
    return total;
}

/* cap: raw products become softcap * tanh(values * scale / softcap) */
static void cap_logits(float *values, int64_t n, float scale, float cap) {
    for (int64_t c = 0; c < n; c++) values[c] = cap * tanhf(values[c] * scale / cap);
}

/* block_scores (analysis/kernels/attention.py's docstring is the definition): logits (n, m) float32
 * finite, overwritten by each row's exponentials; rows (n, ROW_FIELDS); key_positions (m,)
 * increasing; softcap 0 for none, window -1 for none. Returns 0, or -1 when its work space could
 * not be allocated (nothing written then). */
KERNEL static int block_scores(float *logits, int64_t n, int64_t m, double *rows,
                               const int64_t *query_positions, const int64_t *key_positions,
                               double scale, double softcap, int64_t window, int64_t keep,
                               double sink, int has_sink, int64_t sinks, int64_t local,
                               int64_t stream_window) {
    float *as_float = malloc(sizeof(float) * (m > 0 ? m : 1));
    if (!as_float) return -1;
    int64_t base = m ? key_positions[0] : 0;
    for (int64_t j = 0; j < m; j++) as_float[j] = (float)(key_positions[j] - base);
    const int64_t sink_end = search_left(key_positions, m, sinks);
    const float sink32 = (float)sink;
    for (int64_t i = 0; i < n; i++) {
        int64_t p = query_positions[i];
        float *row = logits + i * m;
        double *out = rows + i * ROW_FIELDS;
        for (int f = 0; f < ROW_FIELDS; f++) out[f] = 0.0;
        int64_t end = search_right(key_positions, m, p);
        int64_t early = end, late = end;
        if (window >= 0) {
            early = search_left(key_positions, m, keep);
            early = early < end ? early : end;
            late = search_right(key_positions, m, p - (window - keep));
            late = late > early ? late : early;
        }
        for (int64_t j = early; j < late; j++) row[j] = 0.0f;
        for (int64_t j = end; j < m; j++) row[j] = 0.0f;
        float factor = (float)scale;
        if (softcap > 0) {
            cap_logits(row, early, (float)scale, (float)softcap);
            cap_logits(row + late, end - late, (float)scale, (float)softcap);
            factor = 1.0f;
        }
        int64_t visible = early + (end - late);
        out[VISIBLE_FIELD] = (double)visible;
        float top = largest_of(row + late, end - late, largest_of(row, early, MASKED_LOGIT));
        int64_t best = first_equal(row, early, top);
        if (best < 0) {
            best = late + first_equal(row + late, end - late, top);
            best = best > 0 ? best : 0;
        }
        out[TOP_FIELD] = (double)best;
        top = visible ? top * factor : MASKED_LOGIT;
        if (has_sink) top = top > sink32 ? top : sink32;
        if (!visible && !has_sink) continue;
        float back = (float)(p - base);
        double sums[3] = {0.0, 0.0, 0.0};
        exponentials(row, early, factor, top, back, as_float, sums);
        exponentials(row + late, end - late, factor, top, back, as_float + late, sums);
        double share = has_sink ? (double)exp_nonpositive(sink32 - top) : 0.0;
        float total32 = (float)(sums[0] + share);
        double inverse = 1.0 / (double)total32;
        out[INVERSE_FIELD] = inverse;
        int64_t sunk = sink_end < end ? sink_end : end;
        int64_t recent = search_right(key_positions, m, p - stream_window);
        recent = recent > sunk ? recent : sunk;
        int64_t near = search_right(key_positions, m, p - local);
        near = near > sunk ? near : sunk; /* local weight leaves the sinks to SINK_FIELD */
        out[SINK_FIELD] = sum_of(row, sunk) * inverse;
        out[LOCAL_FIELD] = sum_of(row + near, end - near) * inverse;
        out[KEPT_FIELD] = out[SINK_FIELD] + sum_of(row + recent, end - recent) * inverse;
        out[DISTANCE_FIELD] = sums[2] * inverse;
        /* -sum w log w with log w = (x - top) - log T: no logarithm per key */
        out[ENTROPY_FIELD] = -sums[1] * inverse + log((double)total32) * sums[0] * inverse;
        out[SINK_SHARE_FIELD] = share * inverse;
    }
    free(as_float);
    return 0;
}

/* min_max_levels: x (groups, rows, cols) float32 rounded to levels + 1 steps between its minimum
 * and maximum over ``rows`` (per group and column): ``rint((x - low) / step) * step + low`` with
 * ``step = high > low ? (high - low) / levels : 1``, in float32 and in that order (no contraction:
 * the bits of analysis/attention/compression.py's numpy definition). lows, highs: (cols,) scratch.
 * Returns 1 at the first group holding a NaN or an infinity (the caller then computes the whole
 * array with numpy, whose rules for those these loops do not copy). */
INLINE int min_max_levels(const float *RESTRICT x, int64_t groups, int64_t rows, int64_t cols,
                          float levels, float *RESTRICT out, float *RESTRICT lows,
                          float *RESTRICT highs) {
    const float one = 1.0f;
    for (int64_t g = 0; g < groups; g++) {
        const float *RESTRICT block = x + g * rows * cols;
        float *RESTRICT written = out + g * rows * cols;
        if (cols == 1) { /* along a contiguous row: one scale */
            float low = block[0], high = block[0];
            SIMD_MINMAX(min, low)
            for (int64_t r = 0; r < rows; r++) low = block[r] < low ? block[r] : low;
            SIMD_MINMAX(max, high)
            for (int64_t r = 0; r < rows; r++) high = block[r] > high ? block[r] : high;
            float nonfinite = 0.0f; /* NaN where any value is NaN or infinite */
            SIMD_REDUCE(+, nonfinite)
            for (int64_t r = 0; r < rows; r++) nonfinite += block[r] * 0.0f;
            if (nonfinite != 0.0f || !isfinite(low) || !isfinite(high)) return 1;
            float spread = high - low;
            float step = spread / levels;
            step = high > low ? step : one;
            for (int64_t r = 0; r < rows; r++) {
                float level = (block[r] - low) / step;
                level = level < 4194304.0f ? round_level(level) : rintf(level);
                written[r] = level * step + low;
            }
            continue;
        }
        memcpy(lows, block, cols * sizeof(float));
        memcpy(highs, block, cols * sizeof(float));
        float nonfinite = 0.0f; /* NaN where any value is NaN or infinite */
        for (int64_t r = 0; r < rows; r++) {
            const float *RESTRICT row = block + r * cols;
            SIMD_REDUCE(+, nonfinite)
            for (int64_t c = 0; c < cols; c++) {
                lows[c] = row[c] < lows[c] ? row[c] : lows[c];
                highs[c] = row[c] > highs[c] ? row[c] : highs[c];
                nonfinite += row[c] * 0.0f;
            }
        }
        if (nonfinite != 0.0f) return 1;
        for (int64_t c = 0; c < cols; c++) {
            float spread = highs[c] - lows[c];
            float step = spread / levels;
            highs[c] = highs[c] > lows[c] ? step : one; /* highs now holds each column's step */
        }
        for (int64_t r = 0; r < rows; r++) {
            const float *RESTRICT row = block + r * cols;
            float *RESTRICT target = written + r * cols;
            for (int64_t c = 0; c < cols; c++) {
                float level = (row[c] - lows[c]) / highs[c];
                level = level < 4194304.0f ? round_level(level) : rintf(level);
                target[c] = level * highs[c] + lows[c];
            }
        }
    }
    return 0;
}

KERNEL static int quantize_levels(const float *x, int64_t groups, int64_t rows, int64_t cols,
                                  float levels, float *out, float *lows, float *highs) {
    return min_max_levels(x, groups, rows, cols, levels, out, lows, highs);
}

/* numpy's pairwise sum of n contiguous doubles (numpy/_core/src/umath/loops_utils.h.src,
 * ``pairwise_sum``): the same additions in the same order, so the same bits as ``x.sum(axis=-1)``
 * gives for a row. */
static inline double pairwise_block_f64(const double *a, int64_t n) { /* 8 <= n <= 128 */
    double r[8];
    int64_t i;
    for (int j = 0; j < 8; j++) r[j] = a[j];
    for (i = 8; i < n - (n % 8); i += 8)
        for (int j = 0; j < 8; j++) r[j] += a[i + j];
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++) res += a[i];
    return res;
}

static double pairwise_sum_f64(const double *a, int64_t n) {
    if (n < 8) {
        double res = 0.;
        for (int64_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    if (n <= 128) return pairwise_block_f64(a, n);
    int64_t half = n / 2;
    half -= half % 8;
    return pairwise_sum_f64(a, half) + pairwise_sum_f64(a + half, n - half);
}

/* LagKV's spread, as kvsnap.analysis.attention.compression._lagkv's ``states`` computes it before
 * its softmax: x (parts, lag, cols) float64; for each row of each part p < parts - 1, the standard
 * deviation (ddof 1) over its cols of (x - low) / (high - low), low and high the minimum and the
 * maximum over the rows of part p + 1, per column; numpy's operations in numpy's order (the mean
 * subtracted, then the squares summed), so the same bits; out (parts - 1, lag). work: 3 x cols
 * doubles. Returns 1, writing nothing, where x holds a NaN or an infinity (numpy computes it). */
KERNEL static int lagkv_spread(const double *x, int64_t parts, int64_t lag, int64_t cols, double *out,
                               double *work) {
    int64_t total = parts * lag * cols;
    double probe = 0.0; /* x * 0 is a zero for a finite x, NaN for a NaN or an infinity */
#pragma omp simd reduction(+ : probe)
    for (int64_t i = 0; i < total; i++) probe += x[i] * 0.0;
    if (probe != 0.0) return 1;
    double *low = work, *range = work + cols, *row = work + 2 * cols;
    for (int64_t p = 0; p + 1 < parts; p++) {
        const double *reference = x + (p + 1) * lag * cols;
        for (int64_t c = 0; c < cols; c++) low[c] = range[c] = reference[c];  /* range: the high */
        for (int64_t r = 1; r < lag; r++)
            for (int64_t c = 0; c < cols; c++) {
                double value = reference[r * cols + c];
                low[c] = value < low[c] ? value : low[c];
                range[c] = value > range[c] ? value : range[c];
            }
        for (int64_t c = 0; c < cols; c++) range[c] = range[c] - low[c];
        for (int64_t t = 0; t < lag; t++) {
            const double *scored = x + (p * lag + t) * cols;
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) row[c] = (scored[c] - low[c]) / range[c];
            double mean = (cols >= 8 && cols <= 128 ? pairwise_block_f64(row, cols) : pairwise_sum_f64(row, cols)) /
                          (double)cols;
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) {
                double deviation = row[c] - mean;
                row[c] = deviation * deviation;
            }
            double squares = cols >= 8 && cols <= 128 ? pairwise_block_f64(row, cols) : pairwise_sum_f64(row, cols);
            out[p * lag + t] = sqrt(squares / (double)(cols - 1));
        }
    }
    return 0;
}

/* exp_nonpositive over d (n,) into out (n,): for the tests, which hold it within 1 ulp */
EXPORT void kvsnap_exp_nonpositive(const float *d, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = exp_nonpositive(d[i]);
}

#ifndef KVSNAP_SOURCE_CRC
#define KVSNAP_SOURCE_CRC "" /* built without setup.py: never taken for a source tree's */
#endif

/* The CRC-32 of this file as setup.py read it (8 hex digits): analysis/kernels/native.py compares it with
 * the kernels.c beside the library, if any. */
EXPORT const char *kvsnap_source_crc(void) { return KVSNAP_SOURCE_CRC; }

/* The exported entry points: plain functions calling the cloned ones (clang 14 names an exported
 * target_clones function ``name.ifunc`` and leaves ``name`` undefined). */
EXPORT int kvsnap_accumulate(const Piece *piece, const Settings *settings, RunningSums *running) {
    return accumulate(piece, settings, running);
}

EXPORT void kvsnap_halves_to_float32(const uint16_t *halves, int64_t n, uint32_t *out) {
    halves_to_float32(halves, n, out);
}

EXPORT void kvsnap_eigenvalues_batch(const double *matrices, int64_t count, int64_t n, double *out,
                                     double *work, double *e, int32_t *converged) {
    eigenvalues_batch(matrices, count, n, out, work, e, converged);
}

EXPORT int kvsnap_block_scores(float *logits, int64_t n, int64_t m, double *rows,
                               const int64_t *query_positions, const int64_t *key_positions,
                               double scale, double softcap, int64_t window, int64_t keep,
                               double sink, int has_sink, int64_t sinks, int64_t local,
                               int64_t stream_window) {
    return block_scores(logits, n, m, rows, query_positions, key_positions, scale, softcap,
                        window, keep, sink, has_sink, sinks, local, stream_window);
}

EXPORT int kvsnap_quantize_levels(const float *x, int64_t groups, int64_t rows, int64_t cols,
                                   float levels, float *out, float *lows, float *highs) {
    return quantize_levels(x, groups, rows, cols, levels, out, lows, highs);
}

EXPORT int kvsnap_lagkv_spread(const double *x, int64_t parts, int64_t lag, int64_t cols, double *out,
                                double *work) {
    return lagkv_spread(x, parts, lag, cols, out, work);
}

/* An importable module too (empty), so that setuptools builds and names this library as it
 * does any extension; analysis/kernels/native.py loads the file with ctypes. */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, 0, NULL};
PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
