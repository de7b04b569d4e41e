/* mashbox's CPU kernels: int8-weight matmul, decode and prompt-chunk attention over an fp16 KV
 * cache (bf16 dot products with fp32 sums where the CPU has AVX512-BF16), the per-row norm,
 * rotary and gate ops, and a whole decoder layer built from them.
 *
 * Compiled on first use by mashbox/engine/native.py with the machine's C compiler
 * (-O3 -march=native -fopenmp -pthread, linked against the OpenMP runtime torch already loaded)
 * and called through ctypes on torch tensors' memory.
 *
 * Batch invariance by construction: every output row is computed by the same
 * sequence of floating-point operations whatever other rows are in the call and
 * however many threads run it, so a request's tokens never depend on what runs beside it.
 *
 * Weights come in blocks of 32 along K, in one of two forms: int8 with one fp32 scale per block
 * (llama.cpp's Q8_0, with the scale widened), or a GGUF's own Q4_1 blocks kept as the file has
 * them (fp16 d and m, then 32 four-bit q; w = d * q + m). A matmul quantizes each activation row
 * to int8 blocks, sums int8 x int8 (or x uint4) products exactly in int32 per block and scales
 * them in fp32.
 */
#include <linux/futex.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MB_AVX2 1
/* sum[i] += four u8 x s8 products of lane i, exact in int32: one instruction with VNNI. */
#if defined(__AVXVNNI__)
#define MB_VNNI 1
#define dot4(sum, u, s) _mm256_dpbusd_avx_epi32(sum, u, s)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MB_VNNI 1
#define dot4(sum, u, s) _mm256_dpbusd_epi32(sum, u, s)
#else
#define dot4(sum, u, s) _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#endif
#endif

/* ---- Threads ----
 * A decode step is ~150 calls of 5-300 us each. Waking a sleeping OpenMP thread costs 10-100 us
 * (on a VM ~60 us: docs/performance.md), more than half of most of those calls, and a spinning
 * one takes a core from whatever else runs. So the calls share their work through a pool of their
 * own: its helper threads spin for SPIN_NS after their last job (a step's calls come microseconds
 * apart), yielding their core to any other thread that wants it after YIELD_NS, then sleep on a
 * futex. A job is n tasks handed out one at a time by a ticket that holds the job's generation,
 * its n and the next task, taken by compare-and-swap. The caller takes tasks too, so a helper slow
 * to wake only leaves more of them to the caller; one preempted in the middle of a task makes the
 * caller wait, so after that the caller runs its jobs alone for a while. A task writes its own
 * outputs, so no result depends on which thread ran it or on how many did. One job runs at a
 * time; a second caller (another thread) runs its job alone. */
#define POOL_WORK (1LL << 19) /* the least work (multiply-adds) a call shares */
#define SPIN_NS 200000
#define YIELD_NS 20000
#define MAX_THREADS 64

typedef void (*task_fn)(void *arg, int64_t task, int who);

static struct {
    pthread_mutex_t busy;
    pid_t pid;                 /* helpers run in this process (a forked child starts its own) */
    int helpers;               /* helpers started */
    int64_t backoff, alone;    /* jobs to run alone after a late helper; how many are left */
    _Atomic int width;         /* threads the running job may use */
    _Atomic uint32_t gen;      /* bumped for each job: the futex the helpers sleep on */
    _Atomic int sleepers;
    _Atomic uint64_t ticket;   /* generation (24 bits), n (20), next task (20) */
    _Atomic int64_t done;
    task_fn fn;
    void *arg;
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER};

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Run tasks of job `gen` until none is left to take; how many it ran. */
static int64_t take_tasks(uint32_t gen, int who) {
    int64_t ran = 0;
    uint64_t t = atomic_load(&pool.ticket);
    for (;;) {
        uint64_t next = t & 0xFFFFF, n = t >> 20 & 0xFFFFF;
        if ((t >> 40) != (gen & 0xFFFFFF) || next >= n) return ran;
        if (!atomic_compare_exchange_weak(&pool.ticket, &t, t + 1)) continue; /* t now holds the ticket */
        pool.fn(pool.arg, (int64_t)next, who);
        atomic_fetch_add(&pool.done, 1);
        ran++;
        t = atomic_load(&pool.ticket);
    }
}

static void *helper(void *arg) {
    int who = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&pool.gen);
    for (;;) {
        uint64_t since = now_ns();
        uint32_t gen;
        for (int spins = 0; (gen = atomic_load(&pool.gen)) == seen; spins++) {
            relax();
            if (spins % 64) continue;
            uint64_t idle = now_ns() - since;
            if (idle > YIELD_NS) sched_yield(); /* a core other threads want is theirs first */
            if (idle < SPIN_NS) continue;
            atomic_fetch_add(&pool.sleepers, 1);
            syscall(SYS_futex, &pool.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&pool.sleepers, 1);
            since = now_ns();
        }
        seen = gen;
        if (who < pool.width) take_tasks(gen, who);
    }
    return NULL;
}

/* fn(arg, i, who) for i < n, on up to omp_get_max_threads() threads (the caller alone when `work`,
 * the job's multiply-adds, is under POOL_WORK); who < MAX_THREADS names the thread, for its
 * scratch. Returns when every task has finished. */
static void pool_run(task_fn fn, void *arg, int64_t n, int64_t work) {
    int width = omp_get_max_threads();
    width = width < MAX_THREADS ? width : MAX_THREADS;
    if (n <= 1 || width <= 1 || work < POOL_WORK || n > 0xFFFFF || pthread_mutex_trylock(&pool.busy) != 0) {
        for (int64_t i = 0; i < n; i++) fn(arg, i, 0);
        return;
    }
    if (pool.alone > 0) {
        pool.alone--;
        pthread_mutex_unlock(&pool.busy);
        for (int64_t i = 0; i < n; i++) fn(arg, i, 0);
        return;
    }
    if (pool.pid != getpid()) {
        pool.pid = getpid();
        pool.helpers = 0;
    }
    for (; pool.helpers < width - 1; pool.helpers++) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, helper, (void *)(intptr_t)(pool.helpers + 1)) != 0) break;
        pthread_detach(thread);
    }
    uint32_t gen = atomic_load(&pool.gen) + 1;
    pool.fn = fn;
    pool.arg = arg;
    pool.width = width;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.ticket, (uint64_t)(gen & 0xFFFFFF) << 40 | (uint64_t)n << 20);
    atomic_store(&pool.gen, gen);
    if (atomic_load(&pool.sleepers) > 0) syscall(SYS_futex, &pool.gen, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
    uint64_t start = now_ns();
    int64_t mine = take_tasks(gen, 0);
    uint64_t own = now_ns() - start;
    for (int spins = 0; atomic_load(&pool.done) < n; spins++) {
        relax();
        if (spins > 4096) sched_yield();
    }
    /* A helper that held its last task much longer than one of the caller's took was preempted:
     * another process wants its core. Waiting on it costs more than the caller's share, so the next
     * jobs run alone, twice as many each time it happens again; punctual jobs halve that. */
    uint64_t late = now_ns() - start - own;
    if (mine > 0 && late > 2 * own / (uint64_t)mine + 20000) {
        pool.backoff = pool.backoff < 4096 ? 2 * pool.backoff + 32 : 8192;
        pool.alone = pool.backoff;
    } else {
        pool.backoff /= 2;
    }
    pthread_mutex_unlock(&pool.busy);
}

#define QK 32

#ifdef MB_AVX2
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#endif

/* One row as int8 blocks of 32: q[K], s[K / 32] (max |x| / 127 per block, rounded to nearest even). */
static void quantize_row(const float *x, int8_t *q, float *s, int64_t K) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *src = x + b * QK;
#ifdef MB_AVX2
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(src + 8 * i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float amax = _mm_cvtss_f32(h);
        float scale = amax / 127.0f, inv = scale > 0 ? 1.0f / scale : 0.0f;
        s[b] = scale;
        __m256 vi = _mm256_set1_ps(inv);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], vi)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], vi));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], vi)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], vi));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QK), p);
#else
        float amax = 0.0f;
        for (int l = 0; l < QK; l++) amax = fmaxf(amax, fabsf(src[l]));
        float scale = amax / 127.0f, inv = scale > 0 ? 1.0f / scale : 0.0f;
        s[b] = scale;
        for (int l = 0; l < QK; l++) q[b * QK + l] = (int8_t)lrintf(src[l] * inv);
#endif
    }
}

/* Outputs are computed in tiles of up to TR activation rows x one group of 8 weight rows. */
#define TR 4
#define G8 8

/* Int8 weights are kept (mb_q8_repack) in groups of 8 rows, block by block: for group g and block
 * b, 256 bytes where byte 32j + 4c + t holds w[c][4j + t] + 128 (as unsigned: VNNI multiplies
 * unsigned by signed bytes, so the activations stay signed and the exact dot is
 * sum((w + 128) x) - 128 sum(x)), and their scales [g, b, 8]. One byte-multiply serves 4
 * positions of 8 rows, and a block's 8 dot products land in the 8 lanes of one register: each lane
 * is one output, which adds its blocks in order, so its value is the same in any tile and with any
 * number of threads. */
void mb_q8_repack(const int8_t *q, const float *s, int8_t *wq, float *ws, int64_t N, int64_t K) {
    int64_t nb = K / QK, groups = (N + G8 - 1) / G8;
    memset(wq, 0x80, groups * nb * G8 * QK);
    memset(ws, 0, sizeof(float) * groups * nb * G8);
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++) {
            int64_t at = (n / G8) * nb + b, c = n % G8;
            ws[at * G8 + c] = s[n * nb + b];
            for (int64_t j = 0; j < QK; j++)
                wq[at * G8 * QK + 32 * (j / 4) + 4 * c + j % 4] = (int8_t)(q[n * K + b * QK + j] ^ 0x80);
        }
}

/* The sum of one block's int8 values. */
static inline int32_t block_sum(const int8_t *q) {
    int32_t sum = 0;
    for (int l = 0; l < QK; l++) sum += q[l];
    return sum;
}

/* Per block of an activation row: the sum of its int8 values (the int8 form's offset). */
static void block_isums(const int8_t *q, int32_t *out, int64_t K) {
    for (int64_t b = 0; b < K / QK; b++) out[b] = block_sum(q + b * QK);
}

#ifdef MB_AVX2
/* y[r, 0..8) for rows r < rows against one group: per block, exact int32 dots, then
 * acc += dot * (ws * xs). With VNNI the stored w + 128 multiplies x directly and 128 sum(x) is
 * taken off; without, w's magnitude multiplies x with w's sign, as pairs of int16 products that
 * cannot overflow. A row's dot runs as two chains (even and odd j, exact in int32 and added) so
 * that the multiply-adds of a tile do not wait on each other. */
static inline __attribute__((always_inline)) void tile(
        const int8_t *xq, const float *xs, const int32_t *xt, const int8_t *w, const float *ws, int64_t K,
        const int rows, float *y, int64_t ldy) {
    int64_t nb = K / QK;
#ifndef MB_VNNI
    (void)xt;
#endif
    __m256 acc[TR];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *blk = w + b * G8 * QK;
        __m256i sum[TR][2];
        for (int r = 0; r < rows; r++) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
        for (int j = 0; j < QK / 4; j++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(blk + 32 * j));
#ifndef MB_VNNI
            wv = _mm256_xor_si256(wv, _mm256_set1_epi8((char)0x80));
            __m256i wa = _mm256_sign_epi8(wv, wv);
#endif
            for (int r = 0; r < rows; r++) {
                int32_t x4;
                memcpy(&x4, xq + r * K + b * QK + 4 * j, 4);
#ifdef MB_VNNI
                sum[r][j & 1] = dot4(sum[r][j & 1], wv, _mm256_set1_epi32(x4));
#else
                sum[r][j & 1] = dot4(sum[r][j & 1], wa, _mm256_sign_epi8(_mm256_set1_epi32(x4), wv));
#endif
            }
        }
        __m256 scale = _mm256_loadu_ps(ws + b * G8);
        for (int r = 0; r < rows; r++) {
            __m256i dot = _mm256_add_epi32(sum[r][0], sum[r][1]);
#ifdef MB_VNNI
            dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(128 * xt[r * nb + b]));
#endif
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(xs[r * nb + b])),
                                     acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(y + r * ldy, acc[r]);
}
#else
static void tile(const int8_t *xq, const float *xs, const int32_t *xt, const int8_t *w, const float *ws, int64_t K,
                 int rows, float *y, int64_t ldy) {
    (void)xt;
    int64_t nb = K / QK;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < G8; c++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *blk = w + b * G8 * QK, *x = xq + r * K + b * QK;
                int32_t sum = 0;
                for (int j = 0; j < QK / 4; j++)
                    for (int t = 0; t < 4; t++) sum += (int8_t)(blk[32 * j + 4 * c + t] ^ 0x80) * x[4 * j + t];
                acc = fmaf((float)sum, ws[b * G8 + c] * xs[r * nb + b], acc);
            }
            y[r * ldy + c] = acc;
        }
}
#endif

/* Rows m.. (at most TR) against group g; a last group past N goes through a scratch row. */
static void tile_at(const int8_t *xq, const float *xs, const int32_t *xt, const int8_t *w, const float *s,
                    int64_t M, int64_t N, int64_t K, int64_t m, int64_t g, float *y) {
    int64_t nb = K / QK, n = g * G8;
    int rows = M - m < TR ? (int)(M - m) : TR;
    const int8_t *xr = xq + m * K, *wg = w + g * nb * G8 * QK;
    const float *sr = xs + m * nb, *sg = s + g * nb * G8;
    const int32_t *tr = xt + m * nb;
    if (N - n < G8) {
        float part[TR * G8];
        tile(xr, sr, tr, wg, sg, K, rows, part, G8);
        for (int r = 0; r < rows; r++) memcpy(y + (m + r) * N + n, part + r * G8, sizeof(float) * (N - n));
        return;
    }
    float *yr = y + m * N + n;
    switch (rows) {
    case 1: tile(xr, sr, tr, wg, sg, K, 1, yr, N); break;
    case 2: tile(xr, sr, tr, wg, sg, K, 2, yr, N); break;
    case 3: tile(xr, sr, tr, wg, sg, K, 3, yr, N); break;
    default: tile(xr, sr, tr, wg, sg, K, 4, yr, N); break;
    }
}

/* A GGUF Q4_1 block: fp16 d and m, then 16 bytes holding q[i] in the low nibble of byte i and
 * q[16 + i] in the high one. */
#define Q41_BYTES 20
/* Kept repacked (mb_q41_repack) in groups of 8 weight rows, block by block: for group g and block
 * b, 160 bytes: the 8 rows' fp16 d, their 8 fp16 m, then 128 bytes of 4-bit q where byte
 * 32i + 4c + t holds q[c][8i + t] in its low nibble and q[c][8i + 4 + t] in its high one. One
 * byte-multiply then serves 4 positions of 8 rows, so a block's 8 dot products come out in the 8
 * lanes of one register, with no horizontal sums; each lane is one output. */
#define G8_BYTES (G8 * Q41_BYTES)

static inline float h2f(uint16_t h);

static inline int q41_at(const uint8_t *blk, int k) {
    return k < 16 ? blk[4 + k] & 15 : blk[4 + k - 16] >> 4;
}

/* src [N, K / 32 * 20] (Q4_1 rows) -> dst [ceil(N / 8), K / 32, 160]; rows past N are zero. */
void mb_q41_repack(const uint8_t *src, uint8_t *dst, int64_t N, int64_t K) {
    int64_t nb = K / QK, groups = (N + G8 - 1) / G8;
    memset(dst, 0, groups * nb * G8_BYTES);
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = src + (n * nb + b) * Q41_BYTES;
            uint8_t *o = dst + ((n / G8) * nb + b) * G8_BYTES;
            int c = (int)(n % G8);
            memcpy(o + 2 * c, blk, 2);
            memcpy(o + 16 + 2 * c, blk + 2, 2);
            for (int i = 0; i < 4; i++)
                for (int t = 0; t < 4; t++)
                    o[32 + 32 * i + 4 * c + t] = (uint8_t)(q41_at(blk, 8 * i + t) | q41_at(blk, 8 * i + 4 + t) << 4);
        }
}

/* Per block of an activation row: xs * (the sum of its int8 values), the weight of m. */
static void block_sums(const int8_t *q, const float *s, float *out, int64_t K) {
    for (int64_t b = 0; b < K / QK; b++) out[b] = s[b] * (float)block_sum(q + b * QK);
}

/* y[r, 0..8) for rows r < rows (at most TR) against one group of 8 weight rows. Per block and
 * output: acc += (exact int dot) * (d * xs), then acc += m * xsum; the same whatever `rows` is.
 * With VNNI a row's dot runs as two chains (low and high nibbles, exact in int32 and added).
 * Without, int16 sums cannot overflow: each of 8 products pairs is at most 2 * 15 * 127. */
#ifdef MB_AVX2
static inline __attribute__((always_inline)) void tile41(
        const int8_t *xq, const float *xs, const float *xm, const uint8_t *w, int64_t K, const int rows,
        float *y, int64_t ldy) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    int64_t nb = K / QK;
    __m256 acc[TR];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * G8_BYTES;
        __m256i sum[TR], sum2[TR];
        for (int r = 0; r < rows; r++) sum[r] = sum2[r] = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            __m256i p = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * i));
            __m256i lo = _mm256_and_si256(p, low), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
            for (int r = 0; r < rows; r++) {
                const int8_t *x = xq + r * K + b * QK + 8 * i;
                int32_t x0, x1;
                memcpy(&x0, x, 4);
                memcpy(&x1, x + 4, 4);
#ifdef MB_VNNI
                sum[r] = dot4(sum[r], lo, _mm256_set1_epi32(x0));
                sum2[r] = dot4(sum2[r], hi, _mm256_set1_epi32(x1));
#else
                sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)));
                sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
#endif
            }
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        for (int r = 0; r < rows; r++) {
#ifdef MB_VNNI
            __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(sum[r], sum2[r]));
#else
            __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r], _mm256_set1_epi16(1)));
#endif
            acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(xs[r * nb + b])), acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xm[r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(y + r * ldy, acc[r]);
}
#else
static void tile41(const int8_t *xq, const float *xs, const float *xm, const uint8_t *w, int64_t K, int rows,
                   float *y, int64_t ldy) {
    int64_t nb = K / QK;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < G8; c++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = w + b * G8_BYTES;
                const int8_t *x = xq + r * K + b * QK;
                int32_t sum = 0;
                for (int i = 0; i < 4; i++)
                    for (int t = 0; t < 4; t++) {
                        uint8_t q = blk[32 + 32 * i + 4 * c + t];
                        sum += (q & 15) * x[8 * i + t] + (q >> 4) * x[8 * i + 4 + t];
                    }
                acc = fmaf((float)sum, h2f(*(const uint16_t *)(blk + 2 * c)) * xs[r * nb + b], acc);
                acc = fmaf(h2f(*(const uint16_t *)(blk + 16 + 2 * c)), xm[r * nb + b], acc);
            }
            y[r * ldy + c] = acc;
        }
}
#endif

/* Rows m.. (at most TR) against group g; a last group past N goes through a scratch row. */
static void tile41_at(const int8_t *xq, const float *xs, const float *xm, const uint8_t *w, int64_t M, int64_t N,
                      int64_t K, int64_t m, int64_t g, float *y) {
    int64_t nb = K / QK;
    int rows = M - m < TR ? (int)(M - m) : TR;
    const int8_t *xr = xq + m * K;
    const float *sr = xs + m * nb, *mr = xm + m * nb;
    const uint8_t *wg = w + g * nb * G8_BYTES;
    int64_t n = g * G8;
    if (N - n < G8) {
        float part[TR * G8];
        tile41(xr, sr, mr, wg, K, rows, part, G8);
        for (int r = 0; r < rows; r++) memcpy(y + (m + r) * N + n, part + r * G8, sizeof(float) * (N - n));
        return;
    }
    float *yr = y + m * N + n;
    switch (rows) {
    case 1: tile41(xr, sr, mr, wg, K, 1, yr, N); break;
    case 2: tile41(xr, sr, mr, wg, K, 2, yr, N); break;
    case 3: tile41(xr, sr, mr, wg, K, 3, yr, N); break;
    default: tile41(xr, sr, mr, wg, K, 4, yr, N); break;
    }
}

/* One matmul as tasks: first x's rows quantized (with the per-block sums each form needs), then
 * the output in spans of weight groups. */
struct matmul {
    const float *x, *s;
    const void *w;
    float *y, *xs, *xm;
    int8_t *xq;
    int32_t *xt;
    int64_t M, N, K, rows_per_task, groups_per_task;
};

static void quantize_task(void *arg, int64_t task, int who) {
    (void)who;
    struct matmul *mm = arg;
    int64_t K = mm->K, nb = K / QK, end = (task + 1) * mm->rows_per_task;
    for (int64_t m = task * mm->rows_per_task; m < end && m < mm->M; m++) {
        quantize_row(mm->x + m * K, mm->xq + m * K, mm->xs + m * nb, K);
        if (mm->s)
            block_isums(mm->xq + m * K, mm->xt + m * nb, K);
        else
            block_sums(mm->xq + m * K, mm->xs + m * nb, mm->xm + m * nb, K);
    }
}

static void tile_task(void *arg, int64_t task, int who) {
    (void)who;
    struct matmul *mm = arg;
    int64_t end = (task + 1) * mm->groups_per_task, groups = (mm->N + G8 - 1) / G8;
    for (int64_t g = task * mm->groups_per_task; g < end && g < groups; g++)
        for (int64_t m = 0; m < mm->M; m += TR) {
            if (mm->s)
                tile_at(mm->xq, mm->xs, mm->xt, mm->w, mm->s, mm->M, mm->N, mm->K, m, g, mm->y);
            else
                tile41_at(mm->xq, mm->xs, mm->xm, mm->w, mm->M, mm->N, mm->K, m, g, mm->y);
        }
}

/* y[M, N] = x[M, K] @ dequant(w).T, x's rows quantized to int8 blocks. w: int8 weights repacked by
 * mb_q8_repack with their scales s, or (s NULL) Q4_1 blocks repacked by mb_q41_repack. */
void mb_linear(const float *x, const void *w, const float *s, float *y, int64_t M, int64_t N, int64_t K) {
    int64_t nb = K / QK, groups = (N + G8 - 1) / G8, parts = 4 * omp_get_max_threads();
    if (M == 0 || N == 0) return;
    struct matmul mm = {.x = x, .s = s, .w = w, .y = y, .M = M, .N = N, .K = K};
    mm.xq = malloc(M * K);
    mm.xs = malloc(sizeof(float) * M * nb * (s ? 1 : 2));
    mm.xm = s ? NULL : mm.xs + M * nb;                    /* Q4_1: xs * the block sums */
    mm.xt = s ? malloc(sizeof(int32_t) * M * nb) : NULL;  /* int8: the block sums */
    mm.rows_per_task = (M + parts - 1) / parts;
    mm.groups_per_task = (groups + parts - 1) / parts;
    /* quantizing an element costs about what 8 multiply-adds do */
    pool_run(quantize_task, &mm, (M + mm.rows_per_task - 1) / mm.rows_per_task, 8 * M * K);
    pool_run(tile_task, &mm, (groups + mm.groups_per_task - 1) / mm.groups_per_task, M * N * K);
    free(mm.xq);
    free(mm.xs);
    free(mm.xt);
}

/* w[N, K] (fp32) -> int8 blocks of 32 with one scale each, the same way as activation rows. */
void mb_q8_quantize(const float *w, int8_t *q, float *s, int64_t N, int64_t K) {
    int64_t nb = K / QK;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) quantize_row(w + n * K, q + n * K, s + n * nb, K);
}

static inline float dot(const float *a, const float *b, int64_t n) {
#ifdef MB_AVX2
    if (n % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        return hsum8(acc);
    }
#endif
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* The KV cache holds fp16 (round to nearest even, as torch converts). */
static inline float h2f(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

static inline uint16_t f2h(float x) {
    _Float16 f = (_Float16)x;
    uint16_t h;
    memcpy(&h, &f, 2);
    return h;
}

#if defined(MB_AVX2) && defined(__F16C__)
#define MB_F16C 1
static inline __m256 load_h8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif

static inline float dot_h(const float *a, const uint16_t *b, int64_t n) {
#ifdef MB_F16C
    if (n % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load_h8(b + i), acc);
        return hsum8(acc);
    }
#endif
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += a[i] * h2f(b[i]);
    return acc;
}

static inline void axpy_h(float *y, float a, const uint16_t *x, int64_t n) {
    int64_t i = 0;
#ifdef MB_F16C
    __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load_h8(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * h2f(x[i]);
}

void mb_chunk_attention(const float *q, int64_t ldq, const uint16_t *k, const uint16_t *v, const int64_t *rows,
                        const int64_t *ns, const int64_t *slots, const int64_t *starts, float *out, int64_t R,
                        int64_t H, int64_t KVH, int64_t D, int64_t ctx, float scale, int64_t bf16);

/* Decode attention for one (row, query head), a task of mb_decode_attention where D % 16 != 0. */
struct heads {
    const float *q;
    int64_t ldq;
    const uint16_t *k, *v;
    const int64_t *rows, *slots, *lens;
    float *out;
    int64_t H, KVH, D, ctx;
    float scale;
    int64_t max_len;
    float *scores[MAX_THREADS];
};

static void head_task(void *arg, int64_t i, int who) {
    struct heads *a = arg;
    int64_t H = a->H, KVH = a->KVH, D = a->D, r = i / H, h = i % H, len = a->lens[r], g = h / (H / KVH);
    if (!a->scores[who]) a->scores[who] = malloc(sizeof(float) * a->max_len);
    float *p = a->scores[who], *o = a->out + (a->rows[r] * H + h) * D, top = -INFINITY, sum = 0.0f;
    const float *qi = a->q + a->rows[r] * a->ldq + h * D;
    const uint16_t *kb = a->k + (a->slots[r] * KVH + g) * a->ctx * D, *vb = a->v + (a->slots[r] * KVH + g) * a->ctx * D;
    for (int64_t t = 0; t < len; t++) {
        p[t] = dot_h(qi, kb + t * D, D) * a->scale;
        top = fmaxf(top, p[t]);
    }
    for (int64_t t = 0; t < len; t++) sum += (p[t] = expf(p[t] - top));
    memset(o, 0, sizeof(float) * D);
    for (int64_t t = 0; t < len; t++) axpy_h(o, p[t] / sum, vb + t * D, D);
}

/* One query row per request over its own slot's keys and values.
 * q: rows of H heads of D (row stride ldq); out: [rows, H, D]; k, v: one layer's fp16 cache
 * [slots, KVH, ctx, D] (each head's positions contiguous); for each of R requests,
 * rows[r] is its query row, slots[r] its slot and lens[r] how many positions it attends to.
 * Where D % 16 == 0, a row is a chunk of one (mb_chunk_attention below, bf16 as there): the query
 * heads of a KV head share each key, converted once, instead of each head reading the cache
 * again; otherwise each head multiplies in fp32. */
void mb_decode_attention(const float *q, int64_t ldq, const uint16_t *k, const uint16_t *v, const int64_t *rows,
                         const int64_t *slots, const int64_t *lens, float *out, int64_t R, int64_t H,
                         int64_t KVH, int64_t D, int64_t ctx, float scale, int64_t bf16) {
    if (D % 16 == 0) {
        int64_t *ns = malloc(sizeof(int64_t) * R * 2), *starts = ns + R;
        for (int64_t r = 0; r < R; r++) {
            ns[r] = 1;
            starts[r] = lens[r] - 1;
        }
        mb_chunk_attention(q, ldq, k, v, rows, ns, slots, starts, out, R, H, KVH, D, ctx, scale, bf16);
        free(ns);
        return;
    }
    struct heads a = {q, ldq, k, v, rows, slots, lens, out, H, KVH, D, ctx, scale, 1, {0}};
    for (int64_t r = 0; r < R; r++) a.max_len = lens[r] > a.max_len ? lens[r] : a.max_len;
    pool_run(head_task, &a, R * H, 2 * R * H * a.max_len * D);
    for (int i = 0; i < MAX_THREADS; i++) free(a.scores[i]);
}

/* ---- Prompt-chunk attention ----
 * Each prompt chunk attends causally over its own slot's cache (which already holds the chunk's
 * own keys): row i of a chunk starting at position p0 sees positions 0..p0+i. Work is split into
 * tasks of (chunk, KV head, block of positions); a task packs the queries of the block's
 * positions for every query head of the KV head (GQA folded into rows), then walks the keys in
 * blocks of KB positions counted from 0: convert the block once (to fp32, or to bf16 pairs where
 * the CPU has AVX512-BF16: MB_BF16 below), scores by a register tile, an online softmax per row in
 * fp32, and the weighted values added. A row's operations depend only on its
 * position and its cache, never on the chunk, the task or the thread around it. */
#define KB 64
#ifndef ROWS
#define ROWS 192 /* query rows a task packs: positions x query heads of one KV head */
#endif

#if defined(__AVX512F__) && defined(MB_F16C)
#define VW 16
#ifdef __AVX512BF16__
#define MB_BF16 1
#endif
typedef __m512 vecf;
#define vzero() _mm512_setzero_ps()
#define vset(x) _mm512_set1_ps(x)
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, x) _mm512_storeu_ps(p, x)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vfnma(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vsub(a, b) _mm512_sub_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vmax(a, b) _mm512_max_ps(a, b)
#define vmin(a, b) _mm512_min_ps(a, b)
#define vdiv(a, b) _mm512_div_ps(a, b)
#define vfloor(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define vexp2i(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#define vhsum(x) _mm512_reduce_add_ps(x)
#define vhmax(x) _mm512_reduce_max_ps(x)
#elif defined(MB_F16C)
#define VW 8
typedef __m256 vecf;
#define vzero() _mm256_setzero_ps()
#define vset(x) _mm256_set1_ps(x)
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, x) _mm256_storeu_ps(p, x)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vfnma(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vmax(a, b) _mm256_max_ps(a, b)
#define vmin(a, b) _mm256_min_ps(a, b)
#define vdiv(a, b) _mm256_div_ps(a, b)
#define vfloor(x) _mm256_floor_ps(x)
#define vexp2i(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
#define vhsum(x) hsum8(x)
static inline float vhmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

#ifdef VW
/* exp(x) for x <= 0 (Cephes' single-precision polynomial, ~1 ulp); below -87 it gives ~0. */
static inline vecf vexp(vecf x) {
    x = vmax(x, vset(-87.0f));
    vecf n = vfloor(vfma(x, vset(1.44269504088896341f), vset(0.5f)));
    x = vfnma(n, vset(0.693359375f), x);
    x = vfnma(n, vset(-2.12194440e-4f), x);
    vecf y = vset(1.9875691500e-4f);
    y = vfma(y, x, vset(1.3981999507e-3f));
    y = vfma(y, x, vset(8.3334519073e-3f));
    y = vfma(y, x, vset(4.1665795894e-2f));
    y = vfma(y, x, vset(1.6666665459e-1f));
    y = vfma(y, x, vset(5.0000001201e-1f));
    y = vfma(y, vmul(x, x), vadd(x, vset(1.0f)));
    return vmul(y, vexp2i(n));
}

static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}
#endif

/* One row's online softmax over a block of which it sees the first n scores: s becomes the
 * weights (zero past n), and the row's running max, sum and output are rescaled. */
static void block_softmax(float *s, int64_t n, float *max, float *sum, float *o, int64_t D) {
    float top = *max, total = 0.0f;
    int64_t j = 0;
#ifdef VW
    if (n >= VW) {
        vecf m = vload(s);
        for (j = VW; j + VW <= n; j += VW) m = vmax(m, vload(s + j));
        float t = vhmax(m);
        top = t > top ? t : top;
    }
#endif
    for (; j < n; j++) top = s[j] > top ? s[j] : top;
#ifdef VW
    for (j = 0; j < KB; j += VW) vstore(s + j, vexp(vsub(vload(s + j), vset(top))));
    for (j = n; j < KB; j++) s[j] = 0.0f;
    vecf acc = vzero();
    for (j = 0; j < KB; j += VW) acc = vadd(acc, vload(s + j));
    total = vhsum(acc);
#else
    for (j = 0; j < KB; j++) total += (s[j] = j < n ? expf(s[j] - top) : 0.0f);
#endif
    if (top == *max) {
        *sum += total;
        return;
    }
    float alpha = expf(*max - top);
    *sum = *sum * alpha + total;
    *max = top;
    for (int64_t d = 0; d < D; d++) o[d] *= alpha;
}

#ifdef MB_BF16
/* With AVX512-BF16, scores and weighted values are dot products of bf16 pairs summed in fp32
 * (vdpbf16ps: two multiply-adds a lane per instruction, twice fp32 FMA's rate), as GPU flash
 * attention does; the softmax stays fp32. A word holds two bf16 (the even index in the low half):
 * queries as qb[M][D/2], a block's keys as kp[D/2][KB] (pairs along D, positions across lanes),
 * its values as vp[KB/2][D] (pairs of positions, D across lanes). */
static inline __m512i bf16_pairs(__m512 even, __m512 odd) {
    __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even));
    __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

/* 16 consecutive floats as 8 words of bf16 pairs. */
static inline __m256i bf16_row(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

static void pack_queries_bf16(const float *src, float scale, uint32_t *dst, int64_t D) {
    for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256((__m256i *)(dst + d / 2), bf16_row(vmul(vload(src + d), vset(scale))));
}

/* tmp: KB * D / 2 words of scratch. */
static void pack_block_bf16(const uint16_t *k, const uint16_t *v, int64_t n, int64_t D,
                            uint32_t *kp, uint32_t *vp, uint32_t *tmp) {
    int64_t D2 = D / 2;
    for (int64_t t = 0; t < KB; t++)
        for (int64_t d = 0; d < D; d += 16) {
            __m256i w = _mm256_setzero_si256();
            if (t < n) w = bf16_row(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(k + t * D + d))));
            _mm256_storeu_si256((__m256i *)(tmp + t * D2 + d / 2), w);
        }
    for (int64_t t = 0; t < KB; t += 8)
        for (int64_t d = 0; d < D2; d += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps((const float *)(tmp + (t + i) * D2 + d));
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps((float *)(kp + (d + i) * KB + t), r[i]);
        }
    for (int64_t t = 0; t < n; t += 2)
        for (int64_t d = 0; d < D; d += 16) {
            __m512 even = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(v + t * D + d))), odd = vzero();
            if (t + 1 < n) odd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(v + (t + 1) * D + d)));
            _mm512_storeu_si512(vp + t / 2 * D + d, bf16_pairs(even, odd));
        }
}

/* s[M][KB] = qb[M] . kp, four rows by a block's 64 positions at a time. M % 4 == 0. */
static void block_scores_bf16(const uint32_t *qb, const uint32_t *kp, float *s, int64_t M, int64_t D) {
    for (int64_t m = 0; m < M; m += 4) {
        __m512 acc[4][KB / 16];
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < KB / 16; i++) acc[r][i] = vzero();
        for (int64_t d = 0; d < D / 2; d++) {
            __m512bh b[KB / 16];
            for (int i = 0; i < KB / 16; i++) b[i] = (__m512bh)_mm512_loadu_si512(kp + d * KB + 16 * i);
            for (int r = 0; r < 4; r++) {
                __m512bh a = (__m512bh)_mm512_set1_epi32((int)qb[(m + r) * (D / 2) + d]);
                for (int i = 0; i < KB / 16; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], a, b[i]);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < KB / 16; i++) vstore(s + (m + r) * KB + 16 * i, acc[r][i]);
    }
}

/* o[m + r] += p[m + r] . vp over the first n positions, for four rows (weights past a row's own
 * count are zero). */
static void block_values4_bf16(const float *p, const uint32_t *vp, float *o, int64_t n, int64_t D) {
    uint32_t pw[4][KB / 2];
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < KB; j += 32) {
            __m512bh pair = _mm512_cvtne2ps_pbh(vload(p + r * KB + j + 16), vload(p + r * KB + j));
            _mm512_storeu_si512(pw[r] + j / 2, (__m512i)pair);
        }
    int64_t pairs = (n + 1) / 2;
    for (int64_t d = 0; d < D; d += 64) {
        int w = D - d >= 64 ? 4 : (int)(D - d) / 16;
        __m512 acc[4][4];
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < w; i++) acc[r][i] = vload(o + r * D + d + 16 * i);
        for (int64_t j = 0; j < pairs; j++) {
            __m512bh b[4];
            for (int i = 0; i < w; i++) b[i] = (__m512bh)_mm512_loadu_si512(vp + j * D + d + 16 * i);
            for (int r = 0; r < 4; r++) {
                __m512bh a = (__m512bh)_mm512_set1_epi32((int)pw[r][j]);
                for (int i = 0; i < w; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], a, b[i]);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < w; i++) vstore(o + r * D + d + 16 * i, acc[r][i]);
    }
}
#endif

/* A block's keys as fp32 kt[D][KB] (positions past n zero) and values as fp32 vb[KB][D].
 * k, v point at the block's first position of one KV head (positions D apart). */
static void widen_block(const uint16_t *k, const uint16_t *v, int64_t n, int64_t D,
                        float *kt, float *vb) {
#ifdef VW
    for (int64_t t = 0; t < KB; t += 8)
        for (int64_t d = 0; d < D; d += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = t + i < n ? load_h8(k + (t + i) * D + d) : _mm256_setzero_ps();
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(kt + (d + i) * KB + t, r[i]);
        }
    for (int64_t t = 0; t < n; t++)
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(vb + t * D + d, load_h8(v + t * D + d));
#else
    for (int64_t t = 0; t < KB; t++)
        for (int64_t d = 0; d < D; d++) kt[d * KB + t] = t < n ? h2f(k[t * D + d]) : 0.0f;
    for (int64_t t = 0; t < n; t++)
        for (int64_t d = 0; d < D; d++) vb[t * D + d] = h2f(v[t * D + d]);
#endif
}

/* s[M][KB] = q[M][D] . kt: each score one fused multiply-add per dimension, in order. M % 4 == 0. */
static void block_scores(const float *q, const float *kt, float *s, int64_t M, int64_t D) {
    for (int64_t m = 0; m < M; m += 4)
#ifdef VW
        for (int64_t j = 0; j < KB; j += 2 * VW) {
            vecf acc[4][2];
            for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = vzero();
            for (int64_t d = 0; d < D; d++) {
                vecf b0 = vload(kt + d * KB + j), b1 = vload(kt + d * KB + j + VW);
                for (int r = 0; r < 4; r++) {
                    vecf a = vset(q[(m + r) * D + d]);
                    acc[r][0] = vfma(a, b0, acc[r][0]);
                    acc[r][1] = vfma(a, b1, acc[r][1]);
                }
            }
            for (int r = 0; r < 4; r++) {
                vstore(s + (m + r) * KB + j, acc[r][0]);
                vstore(s + (m + r) * KB + j + VW, acc[r][1]);
            }
        }
#else
        for (int r = 0; r < 4; r++)
            for (int64_t j = 0; j < KB; j++) {
                float acc = 0.0f;
                for (int64_t d = 0; d < D; d++) acc = fmaf(q[(m + r) * D + d], kt[d * KB + j], acc);
                s[(m + r) * KB + j] = acc;
            }
#endif
}

/* o[m] += p[m] . vb over the first n positions, for rows m and m + 1 (D % 16 == 0). */
static void block_values(const float *p, const float *vb, float *o, int64_t n, int64_t D) {
#ifdef VW
    int64_t d = 0;
    for (; d + 4 * VW <= D; d += 4 * VW) {
        vecf acc[2][4];
        for (int r = 0; r < 2; r++)
            for (int i = 0; i < 4; i++) acc[r][i] = vload(o + r * D + d + VW * i);
        for (int64_t j = 0; j < n; j++) {
            vecf a0 = vset(p[j]), a1 = vset(p[KB + j]);
            for (int i = 0; i < 4; i++) {
                vecf b = vload(vb + j * D + d + VW * i);
                acc[0][i] = vfma(a0, b, acc[0][i]);
                acc[1][i] = vfma(a1, b, acc[1][i]);
            }
        }
        for (int r = 0; r < 2; r++)
            for (int i = 0; i < 4; i++) vstore(o + r * D + d + VW * i, acc[r][i]);
    }
    for (; d < D; d += VW) {
        vecf acc0 = vload(o + d), acc1 = vload(o + D + d);
        for (int64_t j = 0; j < n; j++) {
            vecf b = vload(vb + j * D + d);
            acc0 = vfma(vset(p[j]), b, acc0);
            acc1 = vfma(vset(p[KB + j]), b, acc1);
        }
        vstore(o + d, acc0);
        vstore(o + D + d, acc1);
    }
#else
    for (int r = 0; r < 2; r++)
        for (int64_t j = 0; j < n; j++)
            for (int64_t d = 0; d < D; d++) o[r * D + d] = fmaf(p[r * KB + j], vb[j * D + d], o[r * D + d]);
#endif
}

static void block_values4(const float *p, const float *vb, float *o, int64_t n, int64_t D) {
    block_values(p, vb, o, n, D);
    block_values(p + 2 * KB, vb, o + 2 * D, n, D);
}

/* The task's rows: positions p0..p0+np-1 of one chunk, each with the G query heads of KV head g,
 * whose keys and values k, v hold from position 0; bf16: multiply in bf16 pairs (only where MB_BF16
 * is built; fp32 otherwise). */
static void chunk_task(const float *q, int64_t ldq, const uint16_t *k, const uint16_t *v, int64_t row0,
                       int64_t p0, int64_t np, int64_t g, int64_t G, int64_t D, float scale,
                       float *out, int64_t ldo, float *buf, int bf16) {
    (void)bf16;
    int64_t M = np * G, Mp = (M + 3) / 4 * 4, last = p0 + np - 1;
    float *qs = buf, *kt = qs + Mp * D, *vb = kt + D * KB, *s = vb + KB * D, *o = s + Mp * KB;
    float *max = o + Mp * D, *sum = max + Mp;
    memset(qs, 0, sizeof(float) * Mp * D);
    memset(o, 0, sizeof(float) * Mp * D);
    for (int64_t m = 0; m < Mp; m++) {
        max[m] = -INFINITY;
        sum[m] = 0.0f;
    }
    for (int64_t m = 0; m < M; m++) {
        const float *src = q + (row0 + m / G) * ldq + (g * G + m % G) * D;
#ifdef MB_BF16
        if (bf16) {
            pack_queries_bf16(src, scale, (uint32_t *)qs + m * D / 2, D);
            continue;
        }
#endif
        for (int64_t d = 0; d < D; d++) qs[m * D + d] = src[d] * scale;
    }
    for (int64_t t0 = 0; t0 <= last; t0 += KB) {
        int64_t n = last - t0 + 1 < KB ? last - t0 + 1 : KB;
        const uint16_t *kb = k + t0 * D, *vbk = v + t0 * D;
#ifdef MB_BF16
        if (bf16) {
            pack_block_bf16(kb, vbk, n, D, (uint32_t *)kt, (uint32_t *)vb, (uint32_t *)kt + D * KB / 2);
            block_scores_bf16((uint32_t *)qs, (uint32_t *)kt, s, Mp, D);
        } else
#endif
        {
            widen_block(kb, vbk, n, D, kt, vb);
            block_scores(qs, kt, s, Mp, D);
        }
        for (int64_t m = 0; m < Mp; m += 4) {
            int64_t seen[4], most = 0;
            for (int r = 0; r < 4; r++) {
                int64_t pos = m + r < M ? p0 + (m + r) / G : last, c = pos - t0 + 1;
                seen[r] = c < 0 ? 0 : c > KB ? KB : c;
                most = seen[r] > most ? seen[r] : most;
                if (seen[r] > 0) block_softmax(s + (m + r) * KB, seen[r], max + m + r, sum + m + r, o + (m + r) * D, D);
                else memset(s + (m + r) * KB, 0, sizeof(float) * KB);
            }
#ifdef MB_BF16
            if (bf16) {
                block_values4_bf16(s + m * KB, (uint32_t *)vb, o + m * D, most, D);
                continue;
            }
#endif
            block_values4(s + m * KB, vb, o + m * D, most, D);
        }
    }
    for (int64_t m = 0; m < M; m++) {
        float *dst = out + (row0 + m / G) * ldo + (g * G + m % G) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = o[m * D + d] / sum[m];
    }
}

/* One task of mb_chunk_attention: a block of `span` positions of one chunk, for one KV head. */
struct chunks {
    const float *q;
    int64_t ldq;
    const uint16_t *k, *v;
    const int64_t *rows, *ns, *slots, *starts;
    float *out;
    int64_t H, KVH, D, ctx;
    float scale;
    int64_t span, blocks, floats;
    int bf16;
    float *bufs[MAX_THREADS];
};

static void chunk_attention_task(void *arg, int64_t t, int who) {
    struct chunks *a = arg;
    int64_t KVH = a->KVH, D = a->D, c = t / (KVH * a->blocks), g = t / a->blocks % KVH, first = t % a->blocks * a->span;
    if (first >= a->ns[c]) return;
    if (!a->bufs[who]) a->bufs[who] = malloc(sizeof(float) * a->floats);
    int64_t np = a->ns[c] - first < a->span ? a->ns[c] - first : a->span, base = (a->slots[c] * KVH + g) * a->ctx * D;
    chunk_task(a->q, a->ldq, a->k + base, a->v + base, a->rows[c] + first, a->starts[c] + first, np, g, a->H / KVH, D,
               a->scale, a->out, a->H * D, a->bufs[who], a->bf16);
}

/* R prompt chunks, each attending over its own slot: chunk c's rows are rows[c]..rows[c]+ns[c]-1 of q
 * (H heads of D, row stride ldq), at positions starts[c].. of slot slots[c]; out: [rows, H * D].
 * k, v: one layer's fp16 cache [slots, KVH, ctx, D]. D % 16 == 0. bf16: multiply in bf16 pairs
 * where this build can (mb_attention_bf16), else in fp32. */
void mb_chunk_attention(const float *q, int64_t ldq, const uint16_t *k, const uint16_t *v, const int64_t *rows,
                        const int64_t *ns, const int64_t *slots, const int64_t *starts, float *out, int64_t R,
                        int64_t H, int64_t KVH, int64_t D, int64_t ctx, float scale, int64_t bf16) {
    int64_t G = H / KVH, longest = 1, threads = omp_get_max_threads(), work = 0;
    for (int64_t c = 0; c < R; c++) {
        longest = ns[c] > longest ? ns[c] : longest;
        work += 2 * ns[c] * (starts[c] + ns[c]) * H * D;
    }
    int64_t span = ROWS / G > 1 ? ROWS / G : 1, wanted = (4 * threads + R * KVH - 1) / (R * KVH);
    if ((longest + span - 1) / span < wanted) span = (longest + wanted - 1) / wanted;
    int64_t blocks = (longest + span - 1) / span, Mp = (span * G + 3) / 4 * 4;
    struct chunks a = {q, ldq, k, v, rows, ns, slots, starts, out, H, KVH, D, ctx, scale, span, blocks,
                       Mp * D * 2 + D * KB * 2 + Mp * KB + Mp * 2, bf16 != 0, {0}};
    pool_run(chunk_attention_task, &a, R * KVH * blocks, work);
    for (int i = 0; i < MAX_THREADS; i++) free(a.bufs[i]);
}

/* out[m] = x[m] / rms(x[m]) * w, one row at a time. */
void mb_rms_norm(const float *x, const float *w, float *out, int64_t M, int64_t D, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * D;
        float ss = dot(xm, xm, D) / (float)D, inv = 1.0f / sqrtf(ss + eps);
        for (int64_t i = 0; i < D; i++) out[m * D + i] = w[i] * (xm[i] * inv);
    }
}

/* Rotary embedding in place over the first `heads` heads of each row of x (row stride ld):
 * x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, with cos/sin [ctx, D] at each row's position. */
void mb_rope(float *x, int64_t ld, const int64_t *positions, const float *cos, const float *sin,
             int64_t M, int64_t heads, int64_t D) {
    int64_t half = D / 2;
    for (int64_t m = 0; m < M; m++) {
        const float *c = cos + positions[m] * D, *s = sin + positions[m] * D;
        for (int64_t h = 0; h < heads; h++) {
            float *xh = x + m * ld + h * D;
            for (int64_t i = 0; i < half; i++) {
                float a = xh[i], b = xh[i + half];
                xh[i] = a * c[i] - b * s[i];
                xh[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i]: the gated MLP's activation, with the sigmoid taken as
 * exp(min(g, 0)) / (1 + exp(-|g|)) so that exp never overflows. */
void mb_silu_mul(const float *gu, float *out, int64_t M, int64_t I) {
    for (int64_t m = 0; m < M; m++) {
        const float *gate = gu + m * 2 * I, *up = gate + I;
        int64_t i = 0;
#ifdef VW
        for (; i + VW <= I; i += VW) {
            vecf g = vload(gate + i), sig = vdiv(vexp(vmin(g, vzero())), vadd(vset(1.0f), vexp(vmin(g, vsub(vzero(), g)))));
            vstore(out + m * I + i, vmul(vmul(g, sig), vload(up + i)));
        }
#endif
        for (; i < I; i++) out[m * I + i] = gate[i] * (expf(fminf(gate[i], 0.0f)) / (1.0f + expf(-fabsf(gate[i])))) * up[i];
    }
}

static void add_rows(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* One decoder layer for M rows, x [M, D] updated in place: the same kernels, in the same order,
 * as the runner's general path, so a row's result is the same either way. Each weight is Q8 with
 * its scales, or Q4_1 blocks with NULL scales (mb_linear). Keys and values of each row are stored
 * at its slot and position; it attends over positions 0..pos. Rows of one slot at consecutive
 * positions attend as one prompt chunk (mb_chunk_attention, which gives a row the same result in
 * any chunk; one-token rows are chunks of one, as in mb_decode_attention); where HD % 16 != 0
 * each row attends alone (mb_decode_attention's fp32 heads). */
void mb_layer(float *x, int64_t M, int64_t D, int64_t I, int64_t H, int64_t KVH, int64_t HD,
              float eps, float scale, const float *ln_attn, const void *qkv_w, const float *qkv_s,
              const float *qkv_bias, const void *o_w, const float *o_s, const float *ln_mlp,
              const void *gu_w, const float *gu_s, const void *down_w, const float *down_s,
              const int64_t *slots, const int64_t *positions, const float *cos, const float *sin,
              uint16_t *kcache, uint16_t *vcache, int64_t ctx, int64_t bf16) {
    int64_t ld = (H + 2 * KVH) * HD, wide = D > I ? D : I, n = 0; /* chunks */
    float *h = malloc(sizeof(float) * M * wide), *qkv = malloc(sizeof(float) * M * ld);
    float *attn = malloc(sizeof(float) * M * H * HD), *gu = malloc(sizeof(float) * M * (2 * I > D ? 2 * I : D));
    int64_t *rows = malloc(sizeof(int64_t) * M * 4), *ns = rows + M, *cslots = ns + M, *starts = cslots + M;
    mb_rms_norm(x, ln_attn, h, M, D, eps);
    mb_linear(h, qkv_w, qkv_s, qkv, M, ld, D);
    if (qkv_bias)
        for (int64_t m = 0; m < M; m++) add_rows(qkv + m * ld + 0, qkv_bias, ld);
    mb_rope(qkv, ld, positions, cos, sin, M, H + KVH, HD);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t h = 0; h < KVH; h++) {
            int64_t at = ((slots[m] * KVH + h) * ctx + positions[m]) * HD;
            for (int64_t i = 0; i < HD; i++) {
                kcache[at + i] = f2h(qkv[m * ld + (H + h) * HD + i]);
                vcache[at + i] = f2h(qkv[m * ld + (H + KVH + h) * HD + i]);
            }
        }
        if (n && slots[m] == cslots[n - 1] && positions[m] == starts[n - 1] + ns[n - 1]) {
            ns[n - 1]++;
            continue;
        }
        rows[n] = m;
        ns[n] = 1;
        cslots[n] = slots[m];
        starts[n++] = positions[m];
    }
    if (HD % 16 == 0) {
        mb_chunk_attention(qkv, ld, kcache, vcache, rows, ns, cslots, starts, attn, n, H, KVH, HD, ctx, scale, bf16);
    } else { /* each row over its position + 1 keys */
        for (int64_t m = 0; m < M; m++) {
            rows[m] = m;
            starts[m] = positions[m] + 1;
        }
        mb_decode_attention(qkv, ld, kcache, vcache, rows, slots, starts, attn, M, H, KVH, HD, ctx, scale, bf16);
    }
    mb_linear(attn, o_w, o_s, h, M, D, H * HD);
    add_rows(x, h, M * D);
    mb_rms_norm(x, ln_mlp, h, M, D, eps);
    mb_linear(h, gu_w, gu_s, gu, M, 2 * I, D);
    mb_silu_mul(gu, h, M, I);
    mb_linear(h, down_w, down_s, gu, M, D, I);
    add_rows(x, gu, M * D);
    free(h);
    free(qkv);
    free(attn);
    free(gu);
    free(rows);
}

/* 1 where this build can attend in bf16 pairs (AVX512-BF16), so that the attention calls' `bf16`
 * argument takes effect; 0 where they always multiply in fp32. */
int mb_attention_bf16(void) {
#ifdef MB_BF16
    return 1;
#else
    return 0;
#endif
}
