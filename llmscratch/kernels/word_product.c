/* The one-row products of quantized layers (llmscratch/model/quantize.py), in C for the CPU.

   Decoding one token multiplies one activation row by every weight matrix, so its speed is how fast
   the weights are read and turned into floats. These loops read a layer's stored integers where they
   lie, in the word order of quantize.to_word_order, and keep eight columns per register: the eight
   words of a block give value n of eight neighbouring columns at once, taken out with shifts (and a
   mask for int4), converted to float, and multiplied into a running sum. Nothing weight-sized is
   ever written. quantize.word_product is the same computation in PyTorch, for reading.

   Built on first use by llmscratch/native.py with the machine's C compiler; GCC's and Clang's vector
   extensions give portable eight-lane code (one AVX2 register, two NEON ones). Rows of the output
   are shared among the threads with OpenMP where the compiler has it. */
#include <stdint.h>
#include <string.h>

/* Eight lanes: one 256-bit register on AVX2; GCC and Clang lower it to whatever the CPU has. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
#define WORDS 8
/* Prefetch the words this far ahead (4 KB): one thread streaming a matrix from memory reads it about
   15% faster when the loads it will need are already asked for (measured on an AMD EPYC). */
#define PREFETCH_WORDS 1024

static inline v8f load_v8f(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline v8i load_v8i(const int32_t *p) { v8i v; memcpy(&v, p, sizeof v); return v; }
static inline float hsum(v8f a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* int8: block of 32 columns = 8 words; byte n of word i is column n * 8 + i. */
static float int8_row_dot(const float *x, const int32_t *w, int64_t n_blocks) {
    v8f acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0};
    for (int64_t b = 0; b < n_blocks; b++) {
        v8i words = load_v8i(w + b * WORDS);
        __builtin_prefetch(w + b * WORDS + PREFETCH_WORDS);
        const float *xb = x + b * 4 * WORDS;
        v8u bits = (v8u)words;  /* byte n to the top (unsigned: no overflow), then down with its sign */
        acc0 += load_v8f(xb) * __builtin_convertvector((v8i)(bits << 24) >> 24, v8f);
        acc1 += load_v8f(xb + WORDS) * __builtin_convertvector((v8i)(bits << 16) >> 24, v8f);
        acc2 += load_v8f(xb + 2 * WORDS) * __builtin_convertvector((v8i)(bits << 8) >> 24, v8f);
        acc3 += load_v8f(xb + 3 * WORDS) * __builtin_convertvector(words >> 24, v8f);
    }
    return hsum((acc0 + acc1) + (acc2 + acc3));
}

void int8_word_product(const float *x, const int32_t *w, const float *scales, float *y,
                       int64_t rows, int64_t out_features, int64_t in_features, int n_threads) {
    int64_t n_blocks = in_features / (4 * WORDS);
    #pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1)
    for (int64_t o = 0; o < out_features; o++)
        for (int64_t r = 0; r < rows; r++)
            y[r * out_features + o] = scales[o] * int8_row_dot(x + r * in_features, w + o * (in_features / 4),
                                                               n_blocks);
}

/* int4: block of 64 columns = 8 words; nibble n of word i is column n * 8 + i, stored as q + 8.
   Flipping the top bit of q + 8 gives q as a 4-bit two's complement number, so each value comes out
   with two shifts (up to the top, then down with its sign), as int8's bytes do.
   RUNS: runs of 8 columns per group (1, 2, 4, or 8 for any group of 64 or more), a constant per copy. */
static inline __attribute__((always_inline)) float int4_row_dot_runs(
        const float *x, const int32_t *w, const float *scales, int64_t n_blocks, int64_t group_size, const int RUNS) {
    const v8u flip = (v8u){0} + 0x88888888u;  /* the top bit of each nibble */
    v8f acc = {0};
    for (int64_t b = 0; b < n_blocks; b++) {
        v8u bits = (v8u)load_v8i(w + b * WORDS) ^ flip;  /* q + 8 with its top bit flipped: q as a signed nibble */
        __builtin_prefetch(w + b * WORDS + PREFETCH_WORDS);
        const float *xb = x + b * 8 * WORDS;
        v8f part0 = {0}, part1 = {0};
        for (int n = 0; n < 8; n += 2) {
            part0 += load_v8f(xb + n * WORDS) * __builtin_convertvector((v8i)(bits << (28 - 4 * n)) >> 28, v8f);
            part1 += load_v8f(xb + (n + 1) * WORDS) * __builtin_convertvector((v8i)(bits << (24 - 4 * n)) >> 28, v8f);
            if (RUNS == 1) {
                int64_t column = b * 64 + n * WORDS;
                acc += part0 * scales[column / group_size] + part1 * scales[(column + WORDS) / group_size];
                part0 = part1 = (v8f){0};
            } else if ((n + 2) % RUNS == 0) {
                acc += (part0 + part1) * scales[(b * 64 + n * WORDS) / group_size];
                part0 = part1 = (v8f){0};
            }
        }
    }
    return hsum(acc);
}

static float int4_row_dot(const float *x, const int32_t *w, const float *scales, int64_t n_blocks, int64_t group_size) {
    switch (group_size) {
        case 8: return int4_row_dot_runs(x, w, scales, n_blocks, group_size, 1);
        case 16: return int4_row_dot_runs(x, w, scales, n_blocks, group_size, 2);
        case 32: return int4_row_dot_runs(x, w, scales, n_blocks, group_size, 4);
        default: return int4_row_dot_runs(x, w, scales, n_blocks, group_size, 8);
    }
}

void int4_word_product(const float *x, const int32_t *w, const float *scales, float *y,
                       int64_t rows, int64_t out_features, int64_t in_features, int64_t group_size, int n_threads) {
    int64_t n_blocks = in_features / (8 * WORDS), n_groups = in_features / group_size;
    #pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1)
    for (int64_t o = 0; o < out_features; o++)
        for (int64_t r = 0; r < rows; r++)
            y[r * out_features + o] = int4_row_dot(x + r * in_features, w + o * (in_features / 8),
                                                   scales + o * n_groups, n_blocks, group_size);
}

/* The float32 weight (out_features, in_features), columns in their natural order: for products of
   many rows, which then go to the library's matrix product. Output rows are shared among threads. */
void int8_dequantize(const int32_t *w, const float *scales, float *out, int64_t out_features, int64_t in_features,
                     int n_threads) {
    int64_t n_blocks = in_features / (4 * WORDS);
    #pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1)
    for (int64_t o = 0; o < out_features; o++) {
        const int32_t *row = w + o * (in_features / 4);
        float *dst = out + o * in_features;
        for (int64_t b = 0; b < n_blocks; b++) {
            v8u bits = (v8u)load_v8i(row + b * WORDS);
            v8f values[4] = {__builtin_convertvector((v8i)(bits << 24) >> 24, v8f),
                             __builtin_convertvector((v8i)(bits << 16) >> 24, v8f),
                             __builtin_convertvector((v8i)(bits << 8) >> 24, v8f),
                             __builtin_convertvector((v8i)bits >> 24, v8f)};
            for (int n = 0; n < 4; n++) {
                v8f scaled = values[n] * scales[o];
                memcpy(dst + b * 4 * WORDS + n * WORDS, &scaled, sizeof scaled);
            }
        }
    }
}

void int4_dequantize(const int32_t *w, const float *scales, float *out, int64_t out_features, int64_t in_features,
                     int64_t group_size, int n_threads) {
    const v8i low4 = {15, 15, 15, 15, 15, 15, 15, 15};
    const v8f eight = {8, 8, 8, 8, 8, 8, 8, 8};
    int64_t n_blocks = in_features / (8 * WORDS), n_groups = in_features / group_size;
    #pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1)
    for (int64_t o = 0; o < out_features; o++) {
        const int32_t *row = w + o * (in_features / 8);
        float *dst = out + o * in_features;
        for (int64_t b = 0; b < n_blocks; b++) {
            v8i words = load_v8i(row + b * WORDS);
            for (int n = 0; n < 8; n++) {
                int64_t column = b * 8 * WORDS + n * WORDS;
                v8f scaled = (__builtin_convertvector((words >> (4 * n)) & low4, v8f) - eight)
                             * scales[o * n_groups + column / group_size];
                memcpy(dst + column, &scaled, sizeof scaled);
            }
        }
    }
}
