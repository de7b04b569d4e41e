/* mashbox's CPU kernels: int8-weight matmul, decode and prompt-chunk attention over an fp16 or
 * q8_0 KV cache (bf16 dot products with fp32 sums where the CPU has AVX512-BF16, on the tile unit
 * where it has AMX-BF16), the per-row norm,
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
 * Weights are a GGUF's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), or mashbox's
 * int8 blocks for weights that come as floats, as the file has them or packed at load (the same
 * bytes rearranged a group of rows at a time, "Packed weights" below). A matmul quantizes each
 * activation row to int8 blocks of 32 (of 256 against the K-quants, as llama.cpp's Q8_K), sums the
 * products exactly in int32 per block (on the tile unit, "AMX" below, where the CPU has one and a call
 * has the rows) and scales them in fp32 ("Matmuls over a GGUF's own blocks" below).
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
 * caller wait (running the next jobs alone after that cost the served figures 7-11% and gained nothing
 * with another process busy on a core: docs/performance.md, run AK). A task writes its own
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

/* Run tasks of job `gen` until none is left to take. */
static void take_tasks(uint32_t gen, int who) {
    uint64_t t = atomic_load(&pool.ticket);
    for (;;) {
        uint64_t next = t & 0xFFFFF, n = t >> 20 & 0xFFFFF;
        if ((t >> 40) != (gen & 0xFFFFFF) || next >= n) return;
        if (!atomic_compare_exchange_weak(&pool.ticket, &t, t + 1)) continue; /* t now holds the ticket */
        pool.fn(pool.arg, (int64_t)next, who);
        atomic_fetch_add(&pool.done, 1);
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

/* The threads pool_run shares n tasks of `work` multiply-adds over: up to omp_get_max_threads(), the
 * caller alone where the work is under POOL_WORK. */
static int pool_width(int64_t n, int64_t work) {
    int width = omp_get_max_threads();
    width = width < MAX_THREADS ? width : MAX_THREADS;
    return n <= 1 || width <= 1 || work < POOL_WORK || n > 0xFFFFF ? 1 : width;
}

/* fn(arg, i, who) for i < n, on pool_width(n, work) threads; who < MAX_THREADS names the thread, for its
 * scratch. Returns when every task has finished. */
static void pool_run(task_fn fn, void *arg, int64_t n, int64_t work) {
    int width = pool_width(n, work);
    if (width <= 1 || pthread_mutex_trylock(&pool.busy) != 0) {
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
    take_tasks(gen, 0);
    for (int spins = 0; atomic_load(&pool.done) < n; spins++) {
        relax();
        if (spins > 4096) sched_yield();
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

/* max |x| over 32 values. */
static inline float amax32(const float *x) {
#ifdef MB_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
#else
    float amax = 0.0f;
    for (int l = 0; l < QK; l++) amax = fmaxf(amax, fabsf(x[l]));
    return amax;
#endif
}

/* 32 values times inv, rounded to nearest even, as int8. */
static inline void round32(const float *x, float inv, int8_t *q) {
#ifdef MB_AVX2
    __m256 vi = _mm256_set1_ps(inv);
    __m256i i[4];
    for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), vi));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
#else
    for (int l = 0; l < QK; l++) q[l] = (int8_t)lrintf(x[l] * inv);
#endif
}

/* One row as int8 blocks of `block` values (32; 256 as llama.cpp's Q8_K for the K-quants): q[K],
 * s[K / block] (max |x| / 127 per block), each value rounded to nearest even. */
static void quantize_row(const float *x, int8_t *q, float *s, int64_t K, int block) {
    for (int64_t b = 0; b < K / block; b++) {
        const float *src = x + b * block;
        float amax = 0.0f;
        for (int c = 0; c < block; c += QK) amax = fmaxf(amax, amax32(src + c));
        float scale = amax / 127.0f, inv = scale > 0 ? 1.0f / scale : 0.0f;
        s[b] = scale;
        for (int c = 0; c < block; c += QK) round32(src + c, inv, q + b * block + c);
    }
}

/* ---- Matmuls over a GGUF's own blocks ----
 * A weight is N rows of K, each row its blocks in the file's order, in one of the formats below: ggml's
 * type numbers, and MB_Q8, mashbox's own int8 (an fp32 scale, then 32 int8) for weights that come as
 * floats or in a format these kernels do not read. A matmul quantizes each activation row to int8
 * blocks of 32 (an fp32 scale each, and the sum of its values), then takes the weight GR rows at a
 * time (16 with AVX-512, else 8): it decodes their blocks into a buffer of unsigned bytes (4 positions
 * of the GR rows in 4 GR bytes, so one byte-multiply serves 4 positions of GR rows), a scale for each 16
 * or 32 weights and a min for each 32 where the format has one, then multiplies the buffer by every
 * activation row. A block's dot product is exact in int32 (sum(u x) + offset sum(x)),
 * and each output adds dot * (scale * xs), then min * (xs * sum(x)), block by block in order: one
 * output in each lane, so its value is the same in any tile, beside any rows, on any thread.
 * The K-quants (Q4_K, Q5_K, Q6_K: blocks of 256 with an integer scale for each 16 or 32 weights
 * under one fp16 step) take activations quantized per 256, as llama.cpp's dot products do: a block's
 * units' dot products times their integer scales sum exactly in int32, and the mins against the
 * activations' sums too, so an output adds two fp32 terms a block of 256 instead of two a block of
 * 32: the scaling, not the integer products, was most of a K-quant matmul's time. */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, MB_Q8 = 100 };

struct format {
    int values, bytes; /* a block's weights and bytes */
    int unit;          /* weights under one scale: 16 or 32 */
    int offset;        /* w = scale * (u + offset) + min, u the stored unsigned value */
    int min;           /* whether each 32 weights have a min */
};

static int format_of(int64_t fmt, struct format *f) {
    switch (fmt) {
    case Q4_0: *f = (struct format){32, 18, 32, -8, 0}; return 1;
    case Q4_1: *f = (struct format){32, 20, 32, 0, 1}; return 1;
    case Q5_0: *f = (struct format){32, 22, 32, -16, 0}; return 1;
    case Q5_1: *f = (struct format){32, 24, 32, 0, 1}; return 1;
    case Q8_0: *f = (struct format){32, 34, 32, -128, 0}; return 1;
    case Q4_K: *f = (struct format){256, 144, 32, 0, 1}; return 1;
    case Q5_K: *f = (struct format){256, 176, 32, 0, 1}; return 1;
    case Q6_K: *f = (struct format){256, 210, 16, -32, 0}; return 1;
    case MB_Q8: *f = (struct format){32, 36, 32, -128, 0}; return 1;
    }
    return 0;
}

static inline float h2f(uint16_t h);

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h2f(h);
}

/* Without VNNI, unsigned x signed byte products are summed in int16 pairs, which 8-bit weights would
 * overflow: those keep their sign (u = q, offset 0) and multiply as |w| x sign(x, w). */
#ifdef MB_VNNI
#define SIGNED8 0
#else
#define SIGNED8 1
#endif
#define SIGNED(f) (SIGNED8 && (f)->offset == -128)

/* A K-quant block's integer scales sc (one for each unit: 8 six-bit ones, or Q6_K's 16 signed bytes),
 * its six-bit mins mn (one for each 32; Q4_K and Q5_K), and the fp16 steps they multiply: dd, and
 * dmin for the mins. */
static inline void block_kscales(int64_t fmt, const uint8_t *b, int *sc, int *mn, float *dd, float *dmin) {
    if (fmt == Q6_K) {
        *dd = half_at(b + 208), *dmin = 0.0f;
        for (int j = 0; j < 16; j++) sc[j] = (int8_t)b[192 + j];
        return;
    }
    uint32_t u[3], s[2], m[2]; /* 8 six-bit scales and mins in 12 bytes, unpacked 4 at a time */
    memcpy(u, b + 4, 12);
    s[0] = u[0] & 0x3f3f3f3f;
    s[1] = (u[2] & 0x0f0f0f0f) | ((u[0] >> 6) & 0x03030303) << 4;
    m[0] = u[1] & 0x3f3f3f3f;
    m[1] = ((u[2] >> 4) & 0x0f0f0f0f) | ((u[1] >> 6) & 0x03030303) << 4;
    for (int j = 0; j < 8; j++) {
        sc[j] = s[j >> 2] >> 8 * (j & 3) & 0xFF;
        mn[j] = m[j >> 2] >> 8 * (j & 3) & 0xFF;
    }
    *dd = half_at(b);
    *dmin = half_at(b + 2);
}

/* The scales of one block of `fmt` at b, one for each unit, and its mins, one for each 32 (where the
 * format has them), as the file defines them: each exact in fp32 (an fp16 times a small integer). */
static inline void block_scales(int64_t fmt, const uint8_t *b, float *d, float *m) {
    switch (fmt) {
    case Q4_0:
    case Q5_0:
    case Q8_0: d[0] = half_at(b); return;
    case Q4_1:
    case Q5_1:
        d[0] = half_at(b);
        m[0] = half_at(b + 2);
        return;
    case MB_Q8: memcpy(d, b, 4); return;
    case Q4_K:
    case Q5_K:
    case Q6_K: {
        int sc[16], mn[8];
        float dd, dmin = 0.0f;
        block_kscales(fmt, b, sc, mn, &dd, &dmin);
        for (int j = 0; j < (fmt == Q6_K ? 16 : 8); j++) d[j] = dd * (float)sc[j];
        for (int j = 0; fmt != Q6_K && j < 8; j++) m[j] = -dmin * (float)mn[j];
        return;
    }
    }
}

/* One block of `fmt` at b: its weights' stored values u (f.values of them), and its scales and mins
 * (block_scales). */
static void decode_block(int64_t fmt, const uint8_t *b, uint8_t *u, float *d, float *m, int sign) {
    block_scales(fmt, b, d, m);
    switch (fmt) {
    case Q4_0:
    case Q4_1: {
        const uint8_t *qs = b + (fmt == Q4_0 ? 2 : 4);
        for (int i = 0; i < 16; i++) {
            u[i] = qs[i] & 15;
            u[i + 16] = qs[i] >> 4;
        }
        return;
    }
    case Q5_0:
    case Q5_1: {
        int one = fmt == Q5_1;
        const uint8_t *qs = b + (one ? 8 : 6);
        uint32_t qh;
        memcpy(&qh, b + (one ? 4 : 2), 4);
        for (int i = 0; i < 16; i++) {
            u[i] = (uint8_t)((qs[i] & 15) | ((qh >> i) & 1) << 4);
            u[i + 16] = (uint8_t)((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4);
        }
        return;
    }
    case Q8_0:
    case MB_Q8: {
        int at = fmt == Q8_0 ? 2 : 4;
        for (int i = 0; i < 32; i++) u[i] = b[at + i] ^ (sign ? 0 : 0x80);
        return;
    }
    case Q4_K:
    case Q5_K: {
        const uint8_t *qh = b + 16, *qs = b + (fmt == Q4_K ? 16 : 48);
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                uint8_t q = qs[32 * j + l], hi = fmt == Q5_K ? qh[l] >> (2 * j) : 0;
                u[64 * j + l] = (uint8_t)((q & 15) | (hi & 1) << 4);
                u[64 * j + 32 + l] = (uint8_t)((q >> 4) | (hi >> 1 & 1) << 4);
            }
        return;
    }
    case Q6_K: {
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
            uint8_t *o = u + 128 * n;
            for (int l = 0; l < 32; l++) {
                o[l] = (uint8_t)((ql[l] & 15) | (qh[l] & 3) << 4);
                o[l + 32] = (uint8_t)((ql[l + 32] & 15) | (qh[l] >> 2 & 3) << 4);
                o[l + 64] = (uint8_t)((ql[l] >> 4) | (qh[l] >> 4 & 3) << 4);
                o[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (qh[l] >> 6 & 3) << 4);
            }
        }
        return;
    }
    }
}

/* Weight rows decoded together, one per lane of a vector: 16 in zmm where the CPU has AVX-512 with
 * VNNI, else 8 in ymm. gv_* and gf_* are the integer and float vector operations at that width. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define GR 16
typedef __m512i gvi;
typedef __m512 gvf;
#define gv_load(p) _mm512_loadu_si512((const void *)(p))
#define gv_store(p, v) _mm512_storeu_si512((void *)(p), v)
#define gv_set1(x) _mm512_set1_epi32(x)
#define gv_zero() _mm512_setzero_si512()
#define gv_add(a, b) _mm512_add_epi32(a, b)
#define gv_sub(a, b) _mm512_sub_epi32(a, b)
#define gv_and(a, b) _mm512_and_si512(a, b)
#define gv_or(a, b) _mm512_or_si512(a, b)
#define gv_srli(a, n) _mm512_srli_epi32(a, n)
#define gv_slli(a, n) _mm512_slli_epi32(a, n)
#define gv_sll(a, n) _mm512_sll_epi32(a, _mm_cvtsi32_si128(n))
#define gv_srl(a, n) _mm512_srl_epi32(a, _mm_cvtsi32_si128(n))
#define gv_xor(a, b) _mm512_xor_si512(a, b)
#define gv_srai(a, n) _mm512_srai_epi32(a, n)
#define gv_gather(base, at) _mm512_i32gather_epi32(at, (const void *)(base), 1)
#define gv_lanes() _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define gv_mullo(a, b) _mm512_mullo_epi32(a, b)
#define gv_madd(a, b) _mm512_madd_epi16(a, b)
#define gv_dotu(s, u, x) _mm512_dpbusd_epi32(s, u, x)
#define gv_dots(s, w, x) _mm512_dpbusd_epi32(s, w, x)
#define gf_load(p) _mm512_loadu_ps(p)
#define gf_store(p, v) _mm512_storeu_ps(p, v)
#define gf_stream(p, v) _mm512_stream_ps(p, v) /* p 64-byte aligned */
#define gf_set1(x) _mm512_set1_ps(x)
#define gf_zero() _mm512_setzero_ps()
#define gf_mul(a, b) _mm512_mul_ps(a, b)
#define gf_sub(a, b) _mm512_sub_ps(a, b)
#define gf_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define gf_cvt(a) _mm512_cvtepi32_ps(a)
#define gf_halves(v) _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)) /* the fp16 in each lane's low half */
#elif defined(MB_AVX2)
#define GR 8
typedef __m256i gvi;
typedef __m256 gvf;
#define gv_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define gv_store(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define gv_set1(x) _mm256_set1_epi32(x)
#define gv_zero() _mm256_setzero_si256()
#define gv_add(a, b) _mm256_add_epi32(a, b)
#define gv_sub(a, b) _mm256_sub_epi32(a, b)
#define gv_and(a, b) _mm256_and_si256(a, b)
#define gv_or(a, b) _mm256_or_si256(a, b)
#define gv_srli(a, n) _mm256_srli_epi32(a, n)
#define gv_slli(a, n) _mm256_slli_epi32(a, n)
#define gv_sll(a, n) _mm256_sll_epi32(a, _mm_cvtsi32_si128(n))
#define gv_srl(a, n) _mm256_srl_epi32(a, _mm_cvtsi32_si128(n))
#define gv_xor(a, b) _mm256_xor_si256(a, b)
#define gv_srai(a, n) _mm256_srai_epi32(a, n)
#define gv_gather(base, at) _mm256_i32gather_epi32((const int *)(base), at, 1)
#define gv_lanes() _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
#define gv_mullo(a, b) _mm256_mullo_epi32(a, b)
#define gv_madd(a, b) _mm256_madd_epi16(a, b)
#define gv_dotu(s, u, x) dot4u(s, u, x)
#define gv_dots(s, w, x) dot4s(s, w, x)
#define gf_load(p) _mm256_loadu_ps(p)
#define gf_store(p, v) _mm256_storeu_ps(p, v)
#define gf_stream(p, v) _mm256_stream_ps(p, v) /* p 32-byte aligned */
#define gf_set1(x) _mm256_set1_ps(x)
#define gf_zero() _mm256_setzero_ps()
#define gf_mul(a, b) _mm256_mul_ps(a, b)
#define gf_sub(a, b) _mm256_sub_ps(a, b)
#define gf_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define gf_cvt(a) _mm256_cvtepi32_ps(a)
static inline __m256 gf_halves(__m256i v) {
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
#else
#define GR 8
#endif

/* A K-quant block (Q4_K, Q5_K, Q6_K) of GR rows as the tiles take it: each unit's integer scale, the
 * six-bit mins as int16 pairs (mins 0 and 2, 1 and 3, 4 and 6, 5 and 7 of each row: one vpmaddwd each
 * against the activations' sums paired alike), and the fp32 steps: dd, and -dmin for the mins. */
struct kscales {
    int32_t sc[16][GR];
    int32_t mp[4][GR];
    float dd[GR], dmin[GR];
};

/* ---- Packed weights ----
 * At load a weight's blocks are rearranged for the kernels (mb_pack): the same bytes, GR rows at a
 * time, so that one vector load gives a field's 4 bytes of each of the GR rows (one row a lane) and
 * a matmul decodes them without transposing or gathering. Row by row, the blocks are taken a unit
 * at a time: one block, or two where a block has a lone fp16 scale (Q4_0, Q5_0, Q8_0, Q6_K), which
 * then go as [scale 0, scale 1, block 0 without it, block 1 without it], so every field starts on
 * 4 bytes; a Q5_0 or Q5_1 block's 32 high bits are reordered (bit 8t + j holds weight 4j + t's) so
 * that one shift puts the bits of 4 weights on bit 4 of their bytes. Then byte o of row c's unit lies
 * at (o / 4) 4 GR + 4 c + o % 4 of the GR rows' packed unit. A last group's missing rows repeat the
 * weight's last row; an odd count of paired blocks gets a zero block. The format's number + PACKED
 * names the packed form. */
#define PACKED 256

static inline int paired(int64_t fmt) { return fmt == Q4_0 || fmt == Q5_0 || fmt == Q8_0 || fmt == Q6_K; }

/* Where a paired format's lone fp16 scale lies in its block. */
static inline int lone_at(int64_t fmt) { return fmt == Q6_K ? 208 : 0; }

/* Bytes of one packed row of K weights. */
static inline int64_t packed_row_bytes(int64_t fmt, const struct format *f, int64_t K) {
    int64_t pair = paired(fmt) ? 2 : 1;
    return (K / f->values + pair - 1) / pair * pair * f->bytes;
}

/* The 32 high bits of a Q5_0 or Q5_1 block reordered: bit 8t + j takes bit 4j + t. */
static inline void spread_high_bits(uint8_t *qh) {
    uint32_t old, out = 0;
    memcpy(&old, qh, 4);
    for (int t = 0; t < 4; t++) {
#if defined(__BMI2__) && defined(MB_AVX2)
        out |= _pext_u32(old, 0x11111111u << t) << 8 * t;
#else
        for (int j = 0; j < 8; j++) out |= (old >> (4 * j + t) & 1u) << (8 * t + j);
#endif
    }
    memcpy(qh, &out, 4);
}

/* The rows packed together (GR). */
int mb_group_rows(void) { return GR; }

/* Bytes mb_pack writes for N rows of K weights of format fmt; 0 where it does not pack them. */
int64_t mb_packed_bytes(int64_t fmt, int64_t N, int64_t K) {
    struct format f;
#ifdef MB_AVX2
    if (format_of(fmt, &f) && K % f.values == 0 && N > 0) return (N + GR - 1) / GR * GR * packed_row_bytes(fmt, &f, K);
#endif
    (void)fmt, (void)N, (void)K, (void)f;
    return 0;
}

/* The N rows of K weights of format fmt at w, packed into out (mb_packed_bytes of them): each dword of a
 * group's unit gathered from its GR rows at once. */
void mb_pack(const uint8_t *w, int64_t fmt, int64_t N, int64_t K, uint8_t *out) {
#ifdef MB_AVX2
    struct format f;
    if (!mb_packed_bytes(fmt, N, K) || !format_of(fmt, &f)) return;
    int B = f.bytes, pair = paired(fmt) ? 2 : 1, lone = lone_at(fmt), rest = lone == 0 ? 2 : 0;
    int64_t bytes = K / f.values * B, blocks = K / f.values, units = (blocks + pair - 1) / pair;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < (N + GR - 1) / GR; g++) {
        int32_t rows[GR]; /* each lane's row from the group's first, rows past N the last one */
        for (int c = 0; c < GR; c++) rows[c] = (int32_t)(((g * GR + c < N ? g * GR + c : N - 1) - g * GR) * bytes);
        gvi at = gv_load(rows);
        const uint8_t *row0 = w + g * GR * bytes;
        for (int64_t u = 0; u < units; u++) {
            uint8_t *to = out + (g * units + u) * pair * B * GR;
            if (pair == 1) {
                for (int o = 0; o < B; o += 4) gv_store(to + o * GR, gv_gather(row0 + u * B + o, at));
                if (fmt == Q5_1)
                    for (int c = 0; c < GR; c++) spread_high_bits(to + 4 * GR + 4 * c);
                continue;
            }
            gvi scales = gv_zero(); /* the two lone fp16, from the dword that holds each in its block */
            for (int i = 0; i < 2 && 2 * u + i < blocks; i++) {
                gvi dw = gv_gather(row0 + (2 * u + i) * B + (lone ? lone - 2 : 0), at);
                dw = lone ? gv_srli(dw, 16) : gv_and(dw, gv_set1(0xFFFF));
                scales = gv_or(scales, i ? gv_slli(dw, 16) : dw);
            }
            gv_store(to, scales);
            for (int i = 0; i < 2; i++) {
                uint8_t *field = to + (4 + i * (B - 2)) * GR;
                for (int o = 0; o < B - 2; o += 4)
                    gv_store(field + o * GR, 2 * u + i < blocks ? gv_gather(row0 + (2 * u + i) * B + rest + o, at) : gv_zero());
                if (fmt == Q5_0)
                    for (int c = 0; c < GR; c++) spread_high_bits(field + 4 * c);
            }
        }
    }
#else
    (void)w, (void)fmt, (void)N, (void)K, (void)out;
#endif
}

#ifdef MB_AVX2
#ifdef MB_VNNI
#define dot4u(sum, u, x) dot4(sum, u, x)
#define dot4s(sum, w, x) dot4(sum, w, x)
#else
#define dot4u(sum, u, x) _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)))
#define dot4s(sum, w, x) dot4u(sum, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
#endif
#endif

/* Eight 8-dword rows transposed in place: r[i] dword j <-> r[j] dword i. */
#ifdef MB_AVX2
static inline void transpose8i(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}
#endif

#ifdef MB_AVX2
/* Each byte 0xFF where its bit of `bits` is set, else 0. */
static inline __m256i bit_bytes(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_movm_epi8(bits);
#else
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                    _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
#endif
}

/* Weights 32k .. 32k + 31 of the block of `fmt` at b: their stored values, as decode_block gives them. */
static inline __m256i chunk_values(int64_t fmt, const uint8_t *b, int k, int sign) {
    const __m256i low = _mm256_set1_epi8(15);
    switch (fmt) {
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
        int at = fmt == Q4_0 ? 2 : fmt == Q5_1 ? 8 : fmt == Q4_1 ? 4 : 6;
        __m128i qs = _mm_loadu_si128((const __m128i *)(b + at));
        __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), low);
        if (fmt == Q4_0 || fmt == Q4_1) return v;
        uint32_t qh;
        memcpy(&qh, b + at - 4, 4);
        return _mm256_or_si256(v, _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(0x10)));
    }
    case Q8_0:
    case MB_Q8: {
        __m256i v = _mm256_loadu_si256((const __m256i *)(b + (fmt == Q8_0 ? 2 : 4)));
        return sign ? v : _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
    }
    case Q4_K:
    case Q5_K: {
        __m256i q = _mm256_loadu_si256((const __m256i *)(b + (fmt == Q4_K ? 16 : 48) + 32 * (k >> 1)));
        __m256i v = _mm256_and_si256(k & 1 ? _mm256_srli_epi16(q, 4) : q, low);
        if (fmt == Q4_K) return v;
        __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16)); /* bit k of each byte, to bit 4 */
        h = k <= 4 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - k)) : _mm256_srl_epi16(h, _mm_cvtsi32_si128(k - 4));
        return _mm256_or_si256(v, _mm256_and_si256(h, _mm256_set1_epi8(0x10)));
    }
    case Q6_K: {
        int n = k >> 2, s = k & 3;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32 * (s & 1)));
        __m256i v = _mm256_and_si256(s < 2 ? ql : _mm256_srli_epi16(ql, 4), low);
        __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n)); /* bits 2s, 2s + 1 to 4, 5 */
        h = s <= 2 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - 2 * s)) : _mm256_srli_epi16(h, 2);
        return _mm256_or_si256(v, _mm256_and_si256(h, _mm256_set1_epi8(0x30)));
    }
    }
    return _mm256_setzero_si256();
}
#endif

static void group_scales(int64_t fmt, const struct format *f, const uint8_t *blk, int64_t stride, int64_t base,
                         int half, float *d, float *m);
static void kgroup_scales(int64_t fmt, const uint8_t *blk, int64_t stride, int64_t base, int half,
                          struct kscales *ks);

/* Block b's scales where the tiles read them (blk, stride, base and half as group_scales takes them):
 * a K-quant's as kscales b of d, another format's at d + b GR and m + b GR. */
static inline void scales_at(int64_t fmt, const struct format *f, const uint8_t *blk, int64_t stride, int64_t base,
                             int half, float *d, float *m, int64_t b) {
    if (f->values == 256) kgroup_scales(fmt, blk, stride, base, half, (struct kscales *)d + b);
    else group_scales(fmt, f, blk, stride, base, half, d + b * GR, m + b * GR);
}

#ifdef MB_AVX2
/* Dword o (a multiple of 4) of GR rows' blocks: stride bytes apart from blk, or with stride 0 packed
 * (mb_pack: the rows' dwords side by side at blk + o GR). */
static inline gvi dwords(const uint8_t *blk, int64_t o, int64_t stride) {
    return stride ? gv_gather(blk + o, gv_mullo(gv_lanes(), gv_set1((int)stride))) : gv_load(blk + o * GR);
}

/* The scales (and mins) of a block of GR rows into d [units][GR] and m [mins][GR]: the same values as
 * block_scales, computed for the GR rows at once (formats of 32 weights a block). The block's byte o
 * lies at blk's byte base + o, stride bytes apart from row to row (stride 0: packed, base where the
 * block lies in its unit); a paired format's lone fp16 in half `half` of the unit's dword 0 where packed. */
static void group_scales(int64_t fmt, const struct format *f, const uint8_t *blk, int64_t stride, int64_t base,
                         int half, float *d, float *m) {
    gvi low = gv_set1(0xFFFF);
    if (paired(fmt)) { /* the lone scale */
        gvi dd = stride ? dwords(blk, lone_at(fmt), stride) : gv_srli(dwords(blk, 0, 0), 16 * half);
        gf_store(d, gf_halves(gv_and(dd, low)));
        return;
    }
    if (fmt == MB_Q8) {
        gv_store(d, dwords(blk, base, stride));
        return;
    }
    gvi dm = dwords(blk, base, stride); /* Q4_1, Q5_1: the scale and the min */
    gf_store(d, gf_halves(gv_and(dm, low)));
    if (f->min) gf_store(m, gf_halves(gv_srli(dm, 16)));
}

/* kscales of a K-quant block of GR rows, laid out as group_scales takes them (blk, stride, base, half). */
static void kgroup_scales(int64_t fmt, const uint8_t *blk, int64_t stride, int64_t base, int half,
                          struct kscales *ks) {
    gvi low = gv_set1(0xFFFF);
    if (fmt == Q6_K) { /* the lone scale, then 16 signed bytes */
        gvi dd = stride ? dwords(blk, lone_at(fmt), stride) : gv_srli(dwords(blk, 0, 0), 16 * half);
        gf_store(ks->dd, gf_halves(gv_and(dd, low)));
        for (int i = 0; i < 4; i++) {
            gvi sc = dwords(blk, base + 192 + 4 * i, stride);
            for (int j = 0; j < 4; j++) gv_store(ks->sc[4 * i + j], gv_srai(gv_slli(sc, 24 - 8 * j), 24));
        }
        return;
    }
    gvi dd = dwords(blk, base, stride), u0 = dwords(blk, base + 4, stride), u1 = dwords(blk, base + 8, stride),
        u2 = dwords(blk, base + 12, stride);
    gvi lo6 = gv_set1(0x3f3f3f3f), lo4 = gv_set1(0x0f0f0f0f), lo2 = gv_set1(0x03030303), pairs = gv_set1(0x00FF00FF);
    gvi sc[2] = {gv_and(u0, lo6), gv_or(gv_and(u2, lo4), gv_slli(gv_and(gv_srli(u0, 6), lo2), 4))};
    gvi mn[2] = {gv_and(u1, lo6), gv_or(gv_and(gv_srli(u2, 4), lo4), gv_slli(gv_and(gv_srli(u1, 6), lo2), 4))};
    gf_store(ks->dd, gf_halves(gv_and(dd, low)));
    gf_store(ks->dmin, gf_sub(gf_zero(), gf_halves(gv_srli(dd, 16))));
    for (int j = 0; j < 8; j++) gv_store(ks->sc[j], gv_and(gv_srli(sc[j >> 2], 8 * (j & 3)), gv_set1(0xFF)));
    for (int i = 0; i < 2; i++) {
        gv_store(ks->mp[2 * i], gv_and(mn[i], pairs));
        gv_store(ks->mp[2 * i + 1], gv_and(gv_srli(mn[i], 8), pairs));
    }
}

/* Share i of n of the `ahead` bytes at next fetched into the caches: a group's rows are read a unit at
 * a time, which the CPU's prefetchers do not run ahead of; the next group comes in meanwhile, a share with
 * each chunk of 32 values (with each block of 256, bursts that filled the fill buffers: 1-row steps on the
 * 1.5B shape 1.09x slower). */
static inline void fetch_share(const uint8_t *next, int64_t ahead, int64_t i, int64_t n) {
    int64_t share = (ahead + n - 1) / n;
    for (int64_t at = i * share; at < (i + 1) * share && at < ahead; at += 64) __builtin_prefetch(next + at, 0, 1);
}

/* Vector j (weights 4j .. 4j + 3 of each of the GR rows) of chunk k (weights 32k ..) of a packed block:
 * its stored values, as decode_block gives them. The block's byte o lies at unit's byte base + o. */
static inline __attribute__((always_inline)) gvi packed_values(int64_t fmt, const uint8_t *unit, int64_t base, int k,
                                                               int j, int sign) {
    const gvi low = gv_set1(0x0f0f0f0f);
    gvi v, h;
    switch (fmt) {
    case Q8_0:
    case MB_Q8:
        v = dwords(unit, base + (fmt == Q8_0 ? 2 : 4) + 4 * j, 0);
        return sign ? v : gv_xor(v, gv_set1((int)0x80808080));
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
        int qs = fmt == Q4_0 ? 2 : fmt == Q4_1 ? 4 : fmt == Q5_0 ? 6 : 8;
        v = dwords(unit, base + qs + 4 * (j & 3), 0);
        v = gv_and(j < 4 ? v : gv_srli(v, 4), low);
        if (fmt == Q4_0 || fmt == Q4_1) return v;
        h = dwords(unit, base + qs - 4, 0); /* bit 8t + j: weight 4j + t's, to bit 4 of byte t */
        h = j <= 4 ? gv_sll(h, 4 - j) : gv_srl(h, j - 4);
        return gv_or(v, gv_and(h, gv_set1(0x10101010)));
    }
    case Q4_K:
    case Q5_K:
        v = dwords(unit, base + (fmt == Q4_K ? 16 : 48) + 32 * (k >> 1) + 4 * j, 0);
        v = gv_and(k & 1 ? gv_srli(v, 4) : v, low);
        if (fmt == Q4_K) return v;
        h = dwords(unit, base + 16 + 4 * j, 0); /* bit k of each byte, to bit 4 */
        h = k <= 4 ? gv_sll(h, 4 - k) : gv_srl(h, k - 4);
        return gv_or(v, gv_and(h, gv_set1(0x10101010)));
    case Q6_K: {
        int n = k >> 2, s = k & 3;
        v = dwords(unit, base + 64 * n + 32 * (s & 1) + 4 * j, 0);
        v = gv_and(s < 2 ? v : gv_srli(v, 4), low);
        h = dwords(unit, base + 128 + 32 * n + 4 * j, 0); /* bits 2s, 2s + 1 to 4, 5 */
        h = s <= 2 ? gv_sll(h, 4 - 2 * s) : gv_srli(h, 2);
        return gv_or(v, gv_and(h, gv_set1(0x30303030)));
    }
    }
    return gv_zero();
}

/* Block b of a packed group: its unit, returned, where the block's byte o lies at byte *base + o (a
 * paired format's block less its lone scale, which is in half *half of the unit's dword 0). */
static inline const uint8_t *packed_block(int64_t fmt, const struct format *f, const uint8_t *group, int64_t b,
                                          int64_t *base, int *half) {
    int pair = paired(fmt) ? 2 : 1;
    *half = (int)(b % pair);
    *base = pair == 1 ? 0 : 4 + *half * (f->bytes - 2) - (lone_at(fmt) == 0 ? 2 : 0);
    return group + b / pair * pair * f->bytes * GR;
}

/* A packed group of GR rows (mb_pack) decoded for the tiles, as decode_group decodes the rows as the file
 * has them. */
static void decode_packed(int64_t fmt, const struct format *f, const uint8_t *group, int64_t K, uint8_t *q,
                          float *d, float *m, const uint8_t *next, int64_t ahead) {
    int V = f->values, sign = SIGNED(f), half;
    for (int64_t b = 0, base; b < K / V; b++) {
        const uint8_t *unit = packed_block(fmt, f, group, b, &base, &half);
        scales_at(fmt, f, unit, 0, base, half, d, m, b);
        for (int k = 0; k < V / 32; k++) {
            fetch_share(next, ahead, b * V / 32 + k, K / 32);
            uint8_t *out = q + (b * V / 32 + k) * 32 * GR;
            for (int j = 0; j < 8; j++) gv_store(out + 4 * GR * j, packed_values(fmt, unit, base, k, j, sign));
        }
    }
}
#else
static void group_scales(int64_t fmt, const struct format *f, const uint8_t *blk, int64_t stride, int64_t base,
                         int half, float *d, float *m) {
    (void)base, (void)half;
    float ds[16], ms[8];
    for (int c = 0; c < GR; c++) {
        block_scales(fmt, blk + c * stride, ds, ms);
        for (int i = 0; i < f->values / f->unit; i++) d[i * GR + c] = ds[i];
        for (int i = 0; f->min && i < f->values / 32; i++) m[i * GR + c] = ms[i];
    }
}

static void kgroup_scales(int64_t fmt, const uint8_t *blk, int64_t stride, int64_t base, int half, struct kscales *ks) {
    (void)base, (void)half;
    for (int c = 0; c < GR; c++) {
        int sc[16], mn[8];
        block_kscales(fmt, blk + c * stride, sc, mn, &ks->dd[c], &ks->dmin[c]);
        ks->dmin[c] = -ks->dmin[c];
        for (int j = 0; j < (fmt == Q6_K ? 16 : 8); j++) ks->sc[j][c] = sc[j];
        for (int i = 0; fmt != Q6_K && i < 2; i++) {
            ks->mp[2 * i][c] = mn[4 * i] | mn[4 * i + 2] << 16;
            ks->mp[2 * i + 1][c] = mn[4 * i + 1] | mn[4 * i + 3] << 16;
        }
    }
}
#endif

#ifdef MB_AVX2
/* 4-bit formats move their packed bytes, half the shuffles of moving the values: each row's 16 bytes
 * at lo and at hi (stride bytes apart from row to row) are transposed as they are, each byte holding
 * two weights, and then split: out[0..3] take the low nibbles of lo's bytes, out[4..7] their high
 * nibbles, out[8..15] the same of hi's, each out[i] at `at[i]` in a chunk's layout (4 bytes of each
 * row, one row a lane). */
static inline void nibble_chunks(const uint8_t *lo, const uint8_t *hi, int64_t stride, uint8_t *const at[16]) {
    __m256i r[8];
    for (int c = 0; c < 8; c++) r[c] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(hi + c * stride)),
                                                          _mm_loadu_si128((const __m128i *)(lo + c * stride)));
    transpose8i(r);
#if GR == 16
    __m256i h[8];
    for (int c = 0; c < 8; c++) h[c] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(hi + (8 + c) * stride)),
                                                          _mm_loadu_si128((const __m128i *)(lo + (8 + c) * stride)));
    transpose8i(h);
    const __m512i low = _mm512_set1_epi8(15);
    for (int t = 0; t < 8; t++) { /* dword t: lo's bytes 4t.. (t < 4) or hi's bytes 4(t - 4).. */
        __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(r[t]), h[t], 1);
        int i = t < 4 ? t : 4 + t;
        _mm512_storeu_si512(at[i], _mm512_and_si512(v, low));
        _mm512_storeu_si512(at[i + 4], _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
#else
    const __m256i low = _mm256_set1_epi8(15);
    for (int t = 0; t < 8; t++) {
        int i = t < 4 ? t : 4 + t;
        _mm256_storeu_si256((__m256i *)at[i], _mm256_and_si256(r[t], low));
        _mm256_storeu_si256((__m256i *)at[i + 4], _mm256_and_si256(_mm256_srli_epi16(r[t], 4), low));
    }
#endif
}

/* Where nibble_chunks puts its 16 vectors: for Q4_K's 32 bytes of chunks k (low nibbles) and k + 1
 * (high), that chunk's vectors 0..7 and then the next's; for two blocks of Q4_0 or Q4_1 (each 16
 * bytes: weights 0..15 low, 16..31 high) the first block's vectors 0..3, 4..7, then the second's. */
static inline void chunk_targets(uint8_t *first, int k_quant, uint8_t *at[16]) {
    for (int i = 0; i < 16; i++) {
        int chunk = i / 8, j = i % 8;
        if (k_quant) /* i < 4: lo bytes 0..15 low nibbles = chunk k weights 0..15; i 4..7: high = chunk k+1 */
            chunk = (i / 4) & 1, j = (i / 8) * 4 + i % 4;
        at[i] = first + chunk * 32 * GR + 4 * GR * j;
    }
}
#endif

/* GR rows of a weight, `stride` bytes apart from row0, decoded for the tiles: q [K / 4][GR][4] (byte
 * 4Gj + 4c + t of each block of 32 holds row c's weight 4j + t), scales d [K / unit][GR], mins m
 * [K / 32][GR] (where the format has them). The rows are read a block of each in turn, which the
 * CPU's prefetchers do not follow: the `ahead` bytes that come next (the next group's rows) are
 * fetched meanwhile, a share with each block. */
static void decode_group(int64_t fmt, const struct format *f, const uint8_t *row0, int64_t stride, int64_t K,
                         uint8_t *q, float *d, float *m, const uint8_t *next, int64_t ahead) {
    int V = f->values, sign = SIGNED(f);
    int64_t chunks = K / 32, share = (ahead + chunks - 1) / chunks;
    for (int64_t b = 0; b < K / V; b++) {
        const uint8_t *blk = row0 + b * f->bytes;
        scales_at(fmt, f, blk, stride, 0, 0, d, m, b);
#ifdef MB_AVX2
        if ((fmt == Q4_0 || fmt == Q4_1) && b + 1 < K / V) { /* blocks b and b + 1: their packed bytes at once */
            for (int64_t at = b * share; next && at < (b + 2) * share && at < ahead; at += 64)
                __builtin_prefetch(next + at, 0, 1);
            group_scales(fmt, f, blk + f->bytes, stride, 0, 0, d + (b + 1) * GR, m + (b + 1) * GR);
            uint8_t *to[16];
            chunk_targets(q + b * 32 * GR, 0, to);
            nibble_chunks(blk + (fmt == Q4_0 ? 2 : 4), blk + f->bytes + (fmt == Q4_0 ? 2 : 4), stride, to);
            b++;
            continue;
        }
#endif
        for (int k = 0; k < V / 32; k++) {
            int64_t chunk = b * V / 32 + k;
            for (int64_t at = chunk * share; next && at < (chunk + 1) * share && at < ahead; at += 64)
                __builtin_prefetch(next + at, 0, 1);
            uint8_t *out = q + (b * V / 32 + k) * 32 * GR;
#ifdef MB_AVX2
            if (fmt == Q4_K) { /* chunks k and k + 1: their 32 packed bytes at once */
                for (int64_t at = (chunk + 1) * share; next && at < (chunk + 2) * share && at < ahead; at += 64)
                    __builtin_prefetch(next + at, 0, 1);
                uint8_t *to[16];
                chunk_targets(out, 1, to);
                nibble_chunks(blk + 16 + 16 * k, blk + 32 + 16 * k, stride, to);
                k++;
                continue;
            }
            __m256i r[8];
            for (int c = 0; c < 8; c++) r[c] = chunk_values(fmt, blk + c * stride, k, sign);
            transpose8i(r);
#if GR == 16
            __m256i h[8];
            for (int c = 0; c < 8; c++) h[c] = chunk_values(fmt, blk + (8 + c) * stride, k, sign);
            transpose8i(h);
            for (int j = 0; j < 8; j++) _mm512_storeu_si512(out + 64 * j, _mm512_inserti64x4(_mm512_castsi256_si512(r[j]), h[j], 1));
#else
            for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(out + 32 * j), r[j]);
#endif
#else
            uint8_t u[256];
            float ds[16], ms[8];
            for (int c = 0; c < GR; c++) {
                decode_block(fmt, blk + c * stride, u, ds, ms, sign);
                for (int j = 0; j < 8; j++) memcpy(out + 4 * GR * j + 4 * c, &u[32 * k + 4 * j], 4);
            }
#endif
        }
    }
}

typedef int32_t int32_u __attribute__((may_alias, aligned(1))); /* 4 bytes read where they lie */

#ifdef MB_AVX2
/* sum + the four u8 x s8 products of each lane of u against the 4 activations at p, broadcast. With AVX-512
 * they go into the multiply-add as its memory operand ({1to16}): gcc loads them on their own otherwise, and
 * with 8 rows a tile those loads were as many instructions as the multiply-adds (front-end bound: 0.5x). */
static inline __attribute__((always_inline)) gvi dot_at(gvi sum, gvi u, const int8_t *p, const int sign) {
#if GR == 16
    (void)sign;
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sum) : "v"(u), "m"(*(const int32_u *)p));
    return sum;
#else
    gvi x4 = gv_set1(*(const int32_u *)p);
    return sign ? gv_dots(sum, u, x4) : gv_dotu(sum, u, x4);
#endif
}
#endif

/* Outputs are computed in tiles of up to TR activation rows x one group of GR weight rows. */
#define TR (GR == 16 ? 8 : 4) /* 8 rows where 32 vector registers hold their sums (AVX-512), else 4 */

/* A quantized activation row, in blocks of 32: int8 q[K], per 32 the scale s, s * (the sum of its q) sm
 * and minus the sum of its q o (rows of a matmul lie K and K / 32 apart); and in blocks of 256
 * for the K-quants (llama.cpp's Q8_K): int8 kq[K], per 256 the scale ks, per 16 minus the sum ko, per 256 the
 * sums of each 32 as int16 pairs kp[4] (sums 0 and 2, 1 and 3, 4 and 6, 5 and 7, as kscales pairs the
 * mins). A matmul fills the forms its weight's formats take; the other's pointers are NULL. */
struct acts {
    int8_t *q, *kq;
    float *s, *sm, *ks;
    int32_t *o, *ko, *kp;
};

/* Row r of a matmul's activations, K wide. */
static inline struct acts acts_row(struct acts a, int64_t r, int64_t K) {
    struct acts x = a;
    if (a.q) x.q += r * K, x.s += r * (K / 32), x.sm += r * (K / 32), x.o += r * (K / 32);
    if (a.kq) x.kq += r * K, x.ks += r * (K / 256), x.ko += r * (K / 16), x.kp += r * (K / 64);
    return x;
}

#ifdef MB_AVX2

/* Block b (weights 32b ..) of a tile: w[j] holds weights 4j .. 4j + 3 of the GR rows, d and m the block's
 * scale and min. offset, has_min and sign are the format's (constants where this is inlined); up to 4 rows,
 * a block's weights sum in two chains (even and odd j) so that a tile's multiply-adds do not wait on each
 * other (8 rows are chains enough). */
static inline __attribute__((always_inline)) void tile_block(
        struct acts x, const gvi w[8], const float *d, const float *m, int64_t K, int64_t b, const int offset,
        const int has_min, const int sign, const int rows, gvf acc[TR]) {
    int64_t nb = K / 32;
    gvi sum[TR][2];
    /* offset x the activations' sum, -(sum << k): where a chain starts with 8 rows, added at the end with fewer
     * (first in the chain, a one-row step was slower: Gemma's 9.5 against 9.0 ms) */
    for (int r = 0; r < rows; r++) {
        sum[r][0] = offset && rows > 4 ? gv_slli(gv_set1(x.o[r * nb + b]), __builtin_ctz(-offset)) : gv_zero();
        sum[r][1] = gv_zero();
    }
    for (int j = 0; j < 8; j++) {
        int chain = rows > 4 ? 0 : j & 1; /* 8 rows are chains enough */
        for (int r = 0; r < rows; r++)
            sum[r][chain] = dot_at(sum[r][chain], w[j], x.q + r * K + b * 32 + 4 * j, sign);
    }
    for (int r = 0; r < rows; r++) {
        gvi dot = gv_add(sum[r][0], sum[r][1]);
        if (offset && rows <= 4) dot = gv_add(dot, gv_slli(gv_set1(x.o[r * nb + b]), __builtin_ctz(-offset)));
        acc[r] = gf_fma(gf_cvt(dot), gf_mul(gf_load(d), gf_set1(x.s[r * nb + b])), acc[r]);
        if (has_min) acc[r] = gf_fma(gf_load(m), gf_set1(x.sm[r * nb + b]), acc[r]);
    }
}

/* y[r, 0..GR) for the rows r < rows of x against one decoded group. */
static inline __attribute__((always_inline)) void tile(
        struct acts x, const uint8_t *q, const float *d, const float *m, int64_t K, const int offset,
        const int has_min, const int sign, const int rows, float *y, int64_t ldy) {
    gvf acc[TR];
    for (int r = 0; r < rows; r++) acc[r] = gf_zero();
    for (int64_t b = 0; b < K / 32; b++) {
        gvi w[8];
        for (int j = 0; j < 8; j++) w[j] = gv_load(q + b * 32 * GR + 4 * GR * j);
        tile_block(x, w, d + b * GR, m + b * GR, K, b, offset, has_min, sign, rows, acc);
    }
    for (int r = 0; r < rows; r++) gf_store(y + r * ldy, acc[r]);
}

/* y[r, 0..GR) for the rows r < rows (up to TR) of x against one packed group, its weights multiplied as
 * they are loaded (no decoded buffer): the same sums and steps as decode_packed and then tile. fmt and
 * rows are constants where inlined. */
static inline __attribute__((always_inline)) void tile_packed(
        const int64_t fmt, const struct format *f, struct acts x, const uint8_t *group, int64_t K,
        const int offset, const int has_min, const int sign, const int rows, float *y, int64_t ldy,
        const uint8_t *next, int64_t ahead) {
    int half;
    float d[GR], m[GR] = {0}; /* m: where the format has mins */
    gvf acc[TR];
    for (int r = 0; r < rows; r++) acc[r] = gf_zero();
    for (int64_t b = 0, base; b < K / 32; b++) {
        fetch_share(next, ahead, b, K / 32);
        const uint8_t *at = packed_block(fmt, f, group, b, &base, &half);
        group_scales(fmt, f, at, 0, base, half, d, m);
        gvi w[8];
        for (int j = 0; j < 8; j++) w[j] = packed_values(fmt, at, base, 0, j, sign);
        tile_block(x, w, d, m, K, b, offset, has_min, sign, rows, acc);
    }
    for (int r = 0; r < rows; r++) gf_store(y + r * ldy, acc[r]);
}

/* Chunk k (weights 32k ..) of K-quant block c (weights 256c ..) of a tile: w[j] holds weights 4j ..
 * 4j + 3 of the GR rows. Each row's products are summed exactly in int32 (less 32 times the
 * activations' sum where the format's offset is -32: Q6_K) and added to A times its unit's scale. */
static inline __attribute__((always_inline)) void kchunk(struct acts x, const gvi w[8], const struct kscales *s,
                                                         int64_t K, int64_t c, int k, const int unit, const int rows,
                                                         gvi A[TR]) {
    if (rows > 4) { /* 8 rows are chains enough; Q6_K's two units in turn, so that the sums fit the registers */
#pragma GCC unroll 2
        for (int h = 0; h < 32 / unit; h++) {
            gvi sum[TR]; /* Q6_K's start at -32 x the activations' sum */
            for (int r = 0; r < rows; r++)
                sum[r] = unit == 16 ? gv_slli(gv_set1(x.ko[r * (K / 16) + c * 16 + 2 * k + h]), 5) : gv_zero();
#pragma GCC unroll 8
            for (int j = h * unit / 4; j < (h + 1) * unit / 4; j++)
                for (int r = 0; r < rows; r++) sum[r] = dot_at(sum[r], w[j], x.kq + r * K + c * 256 + 32 * k + 4 * j, 0);
            for (int r = 0; r < rows; r++) A[r] = gv_add(A[r], gv_mullo(sum[r], gv_load(s->sc[32 / unit * k + h])));
        }
        return;
    }
    gvi sum[TR][2]; /* two chains a row: even and odd j, or Q6_K's two units (from -32 x the activations' sum) */
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++)
            sum[r][h] = unit == 16 ? gv_slli(gv_set1(x.ko[r * (K / 16) + c * 16 + 2 * k + h]), 5) : gv_zero();
    for (int j = 0; j < 8; j++) {
        int chain = unit == 16 ? j >> 2 : j & 1;
        for (int r = 0; r < rows; r++)
            sum[r][chain] = dot_at(sum[r][chain], w[j], x.kq + r * K + c * 256 + 32 * k + 4 * j, 0);
    }
    for (int r = 0; r < rows; r++) {
        if (unit == 16) {
            for (int h = 0; h < 2; h++) A[r] = gv_add(A[r], gv_mullo(sum[r][h], gv_load(s->sc[2 * k + h])));
        } else {
            A[r] = gv_add(A[r], gv_mullo(gv_add(sum[r][0], sum[r][1]), gv_load(s->sc[k])));
        }
    }
}

/* The end of K-quant block c: each row adds A times dd and its activations' scale, then the mins'
 * sum against the activations' (exact in int32) times -dmin and that scale. */
static inline __attribute__((always_inline)) void kblock_end(struct acts x, const struct kscales *s, int64_t K,
                                                             int64_t c, const int has_min, const int rows,
                                                             const gvi *A, gvf *acc) {
    for (int r = 0; r < rows; r++) {
        gvf xs = gf_set1(x.ks[r * (K / 256) + c]);
        acc[r] = gf_fma(gf_cvt(A[r]), gf_mul(gf_load(s->dd), xs), acc[r]);
        if (!has_min) continue;
        const int32_t *p = x.kp + r * (K / 64) + 4 * c;
        gvi B = gv_madd(gv_load(s->mp[0]), gv_set1(p[0]));
        for (int i = 1; i < 4; i++) B = gv_add(B, gv_madd(gv_load(s->mp[i]), gv_set1(p[i])));
        acc[r] = gf_fma(gf_cvt(B), gf_mul(gf_load(s->dmin), xs), acc[r]);
    }
}

/* tile for a K-quant: its scales are kscales, one for each block of 256. */
static inline __attribute__((always_inline)) void ktile(struct acts x, const uint8_t *q, const struct kscales *ks,
                                                        int64_t K, const int unit, const int has_min, const int rows,
                                                        float *y, int64_t ldy) {
    gvf acc[TR];
    for (int r = 0; r < rows; r++) acc[r] = gf_zero();
    for (int64_t c = 0; c < K / 256; c++) {
        gvi A[TR];
        for (int r = 0; r < rows; r++) A[r] = gv_zero();
        for (int k = 0; k < 8; k++) {
            gvi w[8];
            for (int j = 0; j < 8; j++) w[j] = gv_load(q + (8 * c + k) * 32 * GR + 4 * GR * j);
            kchunk(x, w, ks + c, K, c, k, unit, rows, A);
        }
        kblock_end(x, ks + c, K, c, has_min, rows, A, acc);
    }
    for (int r = 0; r < rows; r++) gf_store(y + r * ldy, acc[r]);
}

/* tile_packed for a K-quant: the same sums and steps as decode_packed and then ktile. */
static inline __attribute__((always_inline)) void ktile_packed(
        const int64_t fmt, const struct format *f, struct acts x, const uint8_t *group, int64_t K, const int unit,
        const int has_min, const int rows, float *y, int64_t ldy, const uint8_t *next, int64_t ahead) {
    int half;
    struct kscales s;
    gvf acc[TR];
    for (int r = 0; r < rows; r++) acc[r] = gf_zero();
    for (int64_t c = 0, base; c < K / 256; c++) {
        const uint8_t *at = packed_block(fmt, f, group, c, &base, &half);
        kgroup_scales(fmt, at, 0, base, half, &s);
        gvi A[TR];
        for (int r = 0; r < rows; r++) A[r] = gv_zero();
        for (int k = 0; k < 8; k++) {
            fetch_share(next, ahead, 8 * c + k, K / 32);
            gvi w[8];
            for (int j = 0; j < 8; j++) w[j] = packed_values(fmt, at, base, k, j, 0);
            kchunk(x, w, &s, K, c, k, unit, rows, A);
        }
        kblock_end(x, &s, K, c, has_min, rows, A, acc);
    }
    for (int r = 0; r < rows; r++) gf_store(y + r * ldy, acc[r]);
}

#if GR == 16 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define MB_AMX 1
/* ---- AMX ----
 * Where the CPU has Intel's tile unit (and Linux lets the process use it), a group's products with 16
 * activation rows at a time are summed by it: exact int32 sums, the integers the vector tiles sum, then
 * scaled by the same float steps as theirs, so that a row's bits are the same whichever path ran them.
 * Packed Q8_0 goes as it is (signed bytes, 4 of each row a lane: the tile unit's layout), one tile a block;
 * from AMX_KROWS rows a K-quant is decoded and its weights multiplied by its scales' digits first
 * (amx_scaled), so that a block's 256 products need no scaling per 32 or 16, and another format is decoded
 * as signed bytes (amx_signed). (K-quants decoded alone, with the scales applied to each unit's sums, were
 * 0.76-1.19x the vector tiles: bench/kernel_ab.py, docs/performance.md.) */
#define AMX_ROWS 16  /* the least rows a matmul takes to the tile unit (packed Q8_0) */
#define AMX_KROWS 48 /* and for the formats decoded first (K-quants at 32 rows 0.95-1.05x) */
struct tile_config {
    uint8_t palette, start, reserved[14];
    uint16_t bytes[16];
    uint8_t rows[16];
};

/* Whether the kernel lets this process use the tiles (asked once: Linux's ARCH_REQ_XCOMP_PERM for XTILEDATA). */
static int amx_allowed(void) {
    static _Atomic int state; /* 0 not asked, 1 allowed, -1 not */
    if (atomic_load(&state) == 0) atomic_store(&state, syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1);
    return atomic_load(&state) > 0;
}

/* This thread's tiles (other code in the process may shape them otherwise between calls): 16 rows of 64
 * bytes (sums of 16 x 16 int32 or fp32, 64 bytes of 16 rows of activations or of weights), but where q8 tiles
 * 4 (32 activations of 16 rows) and 5 (32 weights) for Q8_0's blocks. */
static void amx_configure(int q8) {
    struct tile_config c = {.palette = 1};
    for (int t = 0; t < 8; t++) c.bytes[t] = 64, c.rows[t] = 16;
    if (q8) c.bytes[4] = 32, c.rows[5] = 8;
    _tile_loadconfig(&c);
}

/* Block b0 + i (if i < n) of a packed Q8_0 group (its weights at w[i]) against 16 rows of x: sums[i], in tile i. */
#define AMX_SUM(i)                                                         \
    if (i < n) {                                                           \
        _tile_zero(i);                                                     \
        _tile_loadd(4, x.q + 32 * (b0 + i), K);                            \
        _tile_loadd(5, w[i], 64);                                          \
        _tile_dpbssd(i, 4, 5);                                             \
        _tile_stored(i, sums[i], 64);                                      \
    }

/* tile_packed for packed Q8_0 (or mashbox's int8 blocks) and up to 16 rows on the tile unit, 4 blocks at a time. */
static void amx_q8(int64_t fmt, const struct format *f, struct acts x, const uint8_t *group, int64_t K, int rows,
                   float *y, int64_t ldy, const uint8_t *next, int64_t ahead) {
    int64_t nb = K / 32, base;
    int32_t sums[4][16][GR] __attribute__((aligned(64)));
    float d[4][GR], m[GR];
    gvf acc[16];
    for (int r = 0; r < rows; r++) acc[r] = gf_zero();
    for (int64_t b0 = 0; b0 < nb; b0 += 4) {
        int half, n = nb - b0 < 4 ? (int)(nb - b0) : 4;
        const uint8_t *w[4];
        for (int i = 0; i < n; i++) {
            const uint8_t *at = packed_block(fmt, f, group, b0 + i, &base, &half);
            group_scales(fmt, f, at, 0, base, half, d[i], m);
            w[i] = at + (base + (fmt == Q8_0 ? 2 : 4)) * GR;
        }
        AMX_SUM(0) AMX_SUM(1) AMX_SUM(2) AMX_SUM(3)
        for (int i = 0; i < n; i++) {
            fetch_share(next, ahead, b0 + i, nb); /* a block's share between each block's float steps */
            for (int r = 0; r < rows; r++)
                acc[r] = gf_fma(gf_cvt(gv_load(sums[i][r])), gf_mul(gf_load(d[i]), gf_set1(x.s[r * nb + b0 + i])),
                                acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) gf_store(y + r * ldy, acc[r]);
}

/* A decoded group of 32-value blocks as signed bytes (u + offset: Q4_0's u - 8, Q5_0's u - 16, Q8_0's u - 128;
 * the formats with a min keep u, at most 31) at out, so that the tile unit's sums need no offset term. */
static void amx_signed(const uint8_t *q, int64_t K, int offset, uint8_t *out) {
    const __m512i add = _mm512_set1_epi8((char)offset);
    for (int64_t at = 0; at < GR * K; at += 64) gv_store(out + at, _mm512_add_epi8(gv_load(q + at), add));
}

/* tile for a decoded group of 32-value blocks (qs: amx_signed's) and up to 16 rows on the tile unit, 4 blocks
 * at a time: the sums, then tile_block's float steps. */
static void amx_tile(struct acts x, const uint8_t *qs, const float *d, const float *m, int64_t K, int has_min,
                     int rows, float *y, int64_t ldy) {
    int64_t nb = K / 32;
    int32_t sums[4][16][GR] __attribute__((aligned(64)));
    gvf acc[16];
    for (int r = 0; r < rows; r++) acc[r] = gf_zero();
    for (int64_t b0 = 0; b0 < nb; b0 += 4) {
        int n = nb - b0 < 4 ? (int)(nb - b0) : 4;
        const uint8_t *w[4];
        for (int i = 0; i < n; i++) w[i] = qs + (b0 + i) * 32 * GR;
        AMX_SUM(0) AMX_SUM(1) AMX_SUM(2) AMX_SUM(3)
        for (int i = 0; i < n; i++) {
            int64_t b = b0 + i;
            for (int r = 0; r < rows; r++) {
                acc[r] = gf_fma(gf_cvt(gv_load(sums[i][r])), gf_mul(gf_load(d + b * GR), gf_set1(x.s[r * nb + b])),
                                acc[r]);
                if (has_min) acc[r] = gf_fma(gf_load(m + b * GR), gf_set1(x.sm[r * nb + b]), acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) gf_store(y + r * ldy, acc[r]);
}

/* A decoded K-quant group's weights times the digits of each unit's scale, bytes still, into nd matrices of
 * GR x K at out: Q4_K and Q5_K by their 6-bit scales' low and high 3 bits (at most 31 x 7, unsigned),
 * Q6_K (as signed, less 32) by its int8 scales' 3 digits in base 8 from -3 to 4 (-128 .. 124). Then
 * sum(w sc x) = sum over i of sum(w digit_i x) << 3i, exact, and the tile unit sums a block's 256
 * products against each matrix at once, 64 a tile, where per unit its sums would need scaling. */
static void amx_scaled(int64_t fmt, const uint8_t *q, const struct kscales *ks, int64_t K, uint8_t *out) {
    const int six = fmt == Q6_K, unit = six ? 16 : 32, nd = six ? 3 : 2;
    const __m512i low = _mm512_set1_epi32(0x00FF00FF);
    for (int64_t c = 0; c < K / 256; c++)
        for (int u = 0; u < 256 / unit; u++) {
            __m512i digit[3], sc = gv_load(ks[c].sc[u]);
            for (int i = 0; i < nd; i++) {
                __m512i dg = six ? gv_sub(gv_and(gv_add(sc, gv_set1(3)), gv_set1(7)), gv_set1(3)) : gv_and(sc, gv_set1(7));
                sc = _mm512_srai_epi32(_mm512_sub_epi32(sc, dg), 3);
                digit[i] = _mm512_or_si512(_mm512_and_si512(dg, gv_set1(0xFFFF)), _mm512_slli_epi32(dg, 16));
            }
            for (int j = 0; j < unit / 4; j++) {
                int64_t at = c * 256 * GR + u * unit * GR + 4 * GR * j;
                __m512i v = gv_load(q + at), even, odd;
                if (six) {
                    v = _mm512_sub_epi8(v, _mm512_set1_epi8(32));
                    even = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), odd = _mm512_srai_epi16(v, 8);
                } else {
                    even = _mm512_and_si512(v, low), odd = _mm512_srli_epi16(v, 8);
                }
                for (int i = 0; i < nd; i++)
                    gv_store(out + i * GR * K + at,
                             _mm512_or_si512(_mm512_and_si512(_mm512_mullo_epi16(even, digit[i]), low),
                                             _mm512_slli_epi16(_mm512_mullo_epi16(odd, digit[i]), 8)));
            }
        }
}

/* ktile for a K-quant group (m: amx_scaled's matrices) and up to 16 rows on the tile unit: per block of 256
 * the sums against each matrix (tiles 0 .. nd - 1, 64 activations a tile at a time), A their sum shifted
 * (kchunk's, exact in int32), then kblock_end. */
static void amx_ktile(int64_t fmt, struct acts x, const uint8_t *m, const struct kscales *ks, int64_t K, int rows,
                      float *y, int64_t ldy) {
    const int six = fmt == Q6_K, nd = six ? 3 : 2;
    int32_t sums[3][16][GR] __attribute__((aligned(64)));
    gvf acc[16];
    for (int r = 0; r < rows; r++) acc[r] = gf_zero();
    for (int64_t c = 0; c < K / 256; c++) {
        _tile_zero(0);
        _tile_zero(1);
        if (six) _tile_zero(2);
        for (int p = 0; p < 4; p++) {
            const uint8_t *b = m + (4 * c + p) * 64 * GR;
            _tile_loadd(6, x.kq + c * 256 + 64 * p, K);
            if (six) {
                _tile_loadd(7, b, 64);
                _tile_dpbssd(0, 6, 7);
                _tile_loadd(7, b + GR * K, 64);
                _tile_dpbssd(1, 6, 7);
                _tile_loadd(7, b + 2 * GR * K, 64);
                _tile_dpbssd(2, 6, 7);
            } else {
                _tile_loadd(7, b, 64);
                _tile_dpbsud(0, 6, 7);
                _tile_loadd(7, b + GR * K, 64);
                _tile_dpbsud(1, 6, 7);
            }
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        if (six) _tile_stored(2, sums[2], 64);
        for (int r = 0; r < rows; r++) {
            gvi A = gv_load(sums[nd - 1][r]);
            for (int i = nd - 2; i >= 0; i--) A = gv_add(gv_slli(A, 3), gv_load(sums[i][r]));
            kblock_end(acts_row(x, r, K), ks + c, K, c, !six, 1, &A, &acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) gf_store(y + r * ldy, acc[r]);
}
#endif
#else
static void ktile(struct acts x, const uint8_t *q, const struct kscales *ks, int64_t K, int unit, int has_min,
                  int rows, float *y, int64_t ldy) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < GR; c++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < K / 256; b++) {
                const struct kscales *s = ks + b;
                int32_t A = 0, B = 0;
                for (int k = 0; k < 8; k++) {
                    const uint8_t *blk = q + (8 * b + k) * 32 * GR;
                    const int8_t *xq = x.kq + r * K + b * 256 + 32 * k;
                    int32_t sum[2] = {0, 0};
                    for (int j = 0; j < 8; j++)
                        for (int i = 0; i < 4; i++) sum[unit == 16 ? j >> 2 : 0] += blk[4 * GR * j + 4 * c + i] * xq[4 * j + i];
                    if (unit == 16) {
                        for (int h = 0; h < 2; h++)
                            A += (sum[h] + 32 * x.ko[r * (K / 16) + b * 16 + 2 * k + h]) * s->sc[2 * k + h][c];
                    } else {
                        A += sum[0] * s->sc[k][c];
                    }
                }
                float xs = x.ks[r * (K / 256) + b];
                acc = fmaf((float)A, s->dd[c] * xs, acc);
                if (!has_min) continue;
                for (int i = 0; i < 4; i++) {
                    int32_t mp = s->mp[i][c], p = x.kp[r * (K / 64) + 4 * b + i];
                    B += (int16_t)mp * (int16_t)p + (mp >> 16) * (p >> 16);
                }
                acc = fmaf((float)B, s->dmin[c] * xs, acc);
            }
            y[r * ldy + c] = acc;
        }
}

static void tile(struct acts x, const uint8_t *q, const float *d, const float *m, int64_t K, int offset, int has_min,
                 int sign, int rows, float *y, int64_t ldy) {
    int64_t nb = K / 32;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < GR; c++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = q + b * 32 * GR;
                const int8_t *xq = x.q + r * K + b * 32;
                int32_t sum = -offset * x.o[r * nb + b];
                for (int j = 0; j < 8; j++)
                    for (int i = 0; i < 4; i++) {
                        uint8_t u = blk[4 * GR * j + 4 * c + i];
                        sum += (sign ? (int8_t)u : u) * xq[4 * j + i];
                    }
                acc = fmaf((float)sum, d[b * GR + c] * x.s[r * nb + b], acc);
                if (has_min) acc = fmaf(m[b * GR + c], x.sm[r * nb + b], acc);
            }
            y[r * ldy + c] = acc;
        }
}
#endif

/* The tile's forms: one specialised copy of `tile` each (rows 1..4, and ktile's 1..4 and TR, inlined below). */
#define TILE_ROWS(o, mn, s)                                                      \
    switch (rows) {                                                              \
    case 1: tile(x, q, d, m, K, o, mn, s, 1, y, ldy); break;                     \
    case 2: tile(x, q, d, m, K, o, mn, s, 2, y, ldy); break;                     \
    case 3: tile(x, q, d, m, K, o, mn, s, 3, y, ldy); break;                     \
    default: tile(x, q, d, m, K, o, mn, s, 4, y, ldy); break;                    \
    }

#define KTILE_ROWS(u, mn)                                                        \
    switch (rows) {                                                              \
    case 1: ktile(x, q, ks, K, u, mn, 1, y, ldy); break;                         \
    case 2: ktile(x, q, ks, K, u, mn, 2, y, ldy); break;                         \
    case 3: ktile(x, q, ks, K, u, mn, 3, y, ldy); break;                         \
    case 4: ktile(x, q, ks, K, u, mn, 4, y, ldy); break;                         \
    default: ktile(x, q, ks, K, u, mn, TR, y, ldy); break;                       \
    }

static void tile_any(const struct format *f, const struct acts *a, int64_t r, const uint8_t *q, const float *d,
                     const float *m, int64_t K, int rows, float *y, int64_t ldy) {
    struct acts x = acts_row(*a, r, K);
    const struct kscales *ks = (const struct kscales *)d;
    if (f->values == 256 && f->unit == 16) {
        KTILE_ROWS(16, 0)
    } else if (f->values == 256) {
        KTILE_ROWS(32, 1)
    } else if (SIGNED(f)) {
        TILE_ROWS(0, 0, 1)
    } else if (f->min) {
        TILE_ROWS(0, 1, 0)
    } else if (f->offset == -8) {
        TILE_ROWS(-8, 0, 0)
    } else if (f->offset == -16) {
        TILE_ROWS(-16, 0, 0)
    } else {
        TILE_ROWS(-128, 0, 0)
    }
}

#ifdef MB_AVX2
/* tile_packed in its format's form and for its count of rows (the tile's constants, as tile_any picks them). */
#define PACKED_ROWS(F, o, mn, sg)                                                                      \
    switch (rows) {                                                                                    \
    case 1: tile_packed(F, f, x, group, K, o, mn, sg, 1, y, ldy, next, ahead); return;                \
    case 2: tile_packed(F, f, x, group, K, o, mn, sg, 2, y, ldy, next, ahead); return;                \
    case 3: tile_packed(F, f, x, group, K, o, mn, sg, 3, y, ldy, next, ahead); return;                \
    case 4: tile_packed(F, f, x, group, K, o, mn, sg, 4, y, ldy, next, ahead); return;                \
    default: tile_packed(F, f, x, group, K, o, mn, sg, TR, y, ldy, next, ahead); return;              \
    }

#define KPACKED_ROWS(F, u, mn)                                                                         \
    switch (rows) {                                                                                    \
    case 1: ktile_packed(F, f, x, group, K, u, mn, 1, y, ldy, next, ahead); return;                   \
    case 2: ktile_packed(F, f, x, group, K, u, mn, 2, y, ldy, next, ahead); return;                   \
    case 3: ktile_packed(F, f, x, group, K, u, mn, 3, y, ldy, next, ahead); return;                   \
    case 4: ktile_packed(F, f, x, group, K, u, mn, 4, y, ldy, next, ahead); return;                   \
    default: ktile_packed(F, f, x, group, K, u, mn, TR, y, ldy, next, ahead); return;                 \
    }

static void tile_packed_any(int64_t fmt, const struct format *f, const struct acts *a, int64_t r,
                            const uint8_t *group, int64_t K, int rows, float *y, int64_t ldy, const uint8_t *next,
                            int64_t ahead) {
    struct acts x = acts_row(*a, r, K);
    switch (fmt) {
    case Q4_0: PACKED_ROWS(Q4_0, -8, 0, 0)
    case Q5_0: PACKED_ROWS(Q5_0, -16, 0, 0)
    case Q4_1: PACKED_ROWS(Q4_1, 0, 1, 0)
    case Q5_1: PACKED_ROWS(Q5_1, 0, 1, 0)
    case Q4_K: KPACKED_ROWS(Q4_K, 32, 1)
    case Q5_K: KPACKED_ROWS(Q5_K, 32, 1)
    case Q6_K: KPACKED_ROWS(Q6_K, 16, 0)
    case Q8_0: PACKED_ROWS(Q8_0, SIGNED8 ? 0 : -128, 0, SIGNED8)
    case MB_Q8: PACKED_ROWS(MB_Q8, SIGNED8 ? 0 : -128, 0, SIGNED8)
    }
}
#endif

/* A weight as mb_matmul takes it: up to 3 parts stacked by rows (q, k and v; gate and up), each
 * n[p] rows of its own format, its rows' blocks at data[p]. */
struct weight {
    const uint8_t *data[3];
    int64_t fmt[3], n[3], parts;
};

struct matmul {
    const float *x;
    const struct weight *w;
    float *y;
    struct acts a;
    int64_t M, N, K, rows_per_task, groups_per_task, groups;
    int64_t lanes, lane_tasks; /* task t runs piece t / lanes of lane t % lanes, each lane_tasks pieces */
    int64_t first[4]; /* each part's first group; first[parts] = groups */
    int stream;       /* the output streamed past the caches (put_rows) */
    int amx;          /* enough rows for the tile unit, and it is allowed (AMX below) */
};

/* The sums of each 16 of q's n values into t. */
static void sums16(const int8_t *q, int64_t n, int32_t *t) {
    for (int64_t i = 0; i < n / 16; i++) {
        int32_t sum = 0;
        for (int l = 0; l < 16; l++) sum += q[16 * i + l];
        t[i] = sum;
    }
}

static void quantize_task(void *arg, int64_t task, int who) {
    (void)who;
    struct matmul *mm = arg;
    int64_t K = mm->K, end = (task + 1) * mm->rows_per_task;
    for (int64_t r = task * mm->rows_per_task; r < end && r < mm->M; r++) {
        struct acts x = acts_row(mm->a, r, K);
        if (x.q) {
            quantize_row(mm->x + r * K, x.q, x.s, K, QK);
            for (int64_t b = 0; b < K / QK; b++) {
                int32_t sum = 0;
                for (int l = 0; l < QK; l++) sum += x.q[QK * b + l];
                x.o[b] = -sum;
                x.sm[b] = x.s[b] * (float)sum;
            }
        }
        if (x.kq) {
            quantize_row(mm->x + r * K, x.kq, x.ks, K, 256);
            sums16(x.kq, K, x.ko);
            for (int64_t i = 0; i < K / 64; i++) { /* per 256: sums of 32 paired (0, 2), (1, 3), (4, 6), (5, 7) */
                const int32_t *t = x.ko + 16 * (i / 4) + 8 * (i % 4 / 2) + 2 * (i % 2);
                x.kp[i] = (int32_t)((uint32_t)(uint16_t)(t[0] + t[1]) | (uint32_t)(t[4] + t[5]) << 16);
            }
            for (int64_t i = 0; i < K / 16; i++) x.ko[i] = -x.ko[i];
        }
    }
}

/* This thread's buffer number `which` (0: a decoded group, 1: a last group's rows, 2: a decoded group made
 * ready for the tile unit), grown as needed; each thread has its own. */
static void *thread_buffer(int which, size_t bytes) {
    static __thread void *buf[3];
    static __thread size_t size[3];
    if (bytes > size[which]) {
        free(buf[which]);
        size[which] = (bytes + 4095) / 4096 * 4096;
        buf[which] = aligned_alloc(64, size[which]);
    }
    return buf[which];
}

/* Up to direct_rows(fmt) rows a packed group is multiplied a tile of rows at a time as loaded, with no decoded
 * copy (bench/kernel_ab.py --cold, as in a step, against a decoded copy): at 16 rows 1.05-1.2x faster, and
 * Q5_K and Q6_K, whose high bits cost more to take, 1.06-1.08x; at 24-32 rows the others 1.07-1.3x and these
 * two 0.95-1.03x; at 48-64 rows 0.92-1.06x (with AVX-512's 8-row tiles). */
static inline int64_t direct_rows(int64_t fmt) {
    int slow = fmt == Q5_K || fmt == Q6_K;
    return TR == 8 ? (slow ? 16 : 32) : (slow ? 4 : 16); /* 4-row tiles (AVX2): at 24-32 rows 0.87-1.08x */
}

/* A tile's `rows` rows of GR outputs in `part`, n of each to y (rows ldy apart): streamed past the caches
 * (whole aligned vectors) where the matmul's output is too large to be read back from them. */
static void put_rows(float *y, int64_t ldy, const float *part, int rows, int64_t n, int stream) {
    (void)stream; /* without AVX2: stored as usual */
    for (int i = 0; i < rows; i++) {
        float *to = y + i * ldy;
#ifdef MB_AVX2
        if (stream && n == GR && (uintptr_t)to % sizeof(gvf) == 0) {
            gf_stream(to, gf_load(part + i * GR));
            continue;
        }
#endif
        memcpy(to, part + i * GR, sizeof(float) * n);
    }
}

/* Where group g of a matmul's weight lies (*at) and its bytes, as tile_task reads them. */
static int64_t group_span(const struct matmul *mm, int64_t g, const uint8_t **at) {
    const struct weight *w = mm->w;
    int p = 0;
    while (g >= mm->first[p + 1]) p++;
    struct format f;
    int64_t fmt = w->fmt[p] % PACKED, row0 = (g - mm->first[p]) * GR;
    if (!format_of(fmt, &f)) return 0;
    if (w->fmt[p] >= PACKED) {
        int64_t size = GR * packed_row_bytes(fmt, &f, mm->K);
        *at = w->data[p] + row0 / GR * size;
        return size;
    }
    int64_t bytes = mm->K / f.values * f.bytes, n = w->n[p] - row0 < GR ? w->n[p] - row0 : GR;
    *at = w->data[p] + row0 * bytes;
    return n * bytes;
}

static void tile_task(void *arg, int64_t task, int who) {
    (void)who;
    struct matmul *mm = arg;
    const struct weight *w = mm->w;
    /* the threads take tasks in turn, so each runs through a lane of groups in order, the next group
     * fetched meanwhile, the next task's first one too (tasks of their own, each first group read cold:
     * qwen2.5-coder-0.5b's layers at one row 1.05-1.1x slower; still a task at a time, so a thread that
     * is late leaves the others more) */
    int64_t lane = task % mm->lanes, start = (lane * mm->lane_tasks + task / mm->lanes) * mm->groups_per_task;
    int64_t K = mm->K, end = start + mm->groups_per_task, lane_end = (lane + 1) * mm->lane_tasks * mm->groups_per_task;
    /* decoded values, then scales [K / 16][GR] and mins [K / 32][GR] (a K-quant's kscales, 22 GR floats a
     * block of 256, take both) */
    uint8_t *q = thread_buffer(0, GR * K + sizeof(float) * GR * (K / 16 + K / 32));
    float *d = (float *)(q + GR * K), *m = d + GR * (K / 16);
#ifdef MB_AMX
    if (mm->amx) amx_configure(1);
#endif
    for (int64_t g = start; g < end && g < mm->groups; g++) {
        int p = 0, col = 0;
        while (g >= mm->first[p + 1]) col += w->n[p++];
        struct format f;
        int64_t fmt = w->fmt[p] % PACKED;
        if (!format_of(fmt, &f)) continue;
        int64_t row0 = (g - mm->first[p]) * GR, n = w->n[p] - row0 < GR ? w->n[p] - row0 : GR, bytes = K / f.values * f.bytes;
        /* a last group's rows past the weight's end decode its last row again (their lanes are dropped) */
        const uint8_t *first = NULL, *next = NULL;
        group_span(mm, g, &first);
        /* the lane's next group (of this part or the next one) */
        int64_t ahead = g + 1 < lane_end && g + 1 < mm->groups ? group_span(mm, g + 1, &next) : 0;
        float *y = mm->y + col + row0, part[16 * GR];
        int to_part = n < GR || mm->stream; /* the tiles write to part, put_rows to y */
        int as_loaded = 0; /* a packed group (at first) multiplied as loaded, with no decoded copy */
        int amx = 0, amx_decoded = 0; /* on the tile unit: packed Q8_0 as it is; others decoded, scaled or signed */
#ifdef MB_AMX
        amx = mm->amx && w->fmt[p] >= PACKED && (fmt == Q8_0 || fmt == MB_Q8);
        amx_decoded = mm->amx && mm->M >= AMX_KROWS && !amx;
#endif
        if (w->fmt[p] >= PACKED) {
#ifdef MB_AVX2
            as_loaded = amx || (!amx_decoded && mm->M <= direct_rows(fmt));
            if (!as_loaded) decode_packed(fmt, &f, first, K, q, d, m, next, ahead);
#endif
        } else if (n == GR) {
            decode_group(w->fmt[p], &f, first, bytes, K, q, d, m, next, ahead);
        } else { /* rows n.. alias row n - 1: as the stride cannot, copy the last group into a full one */
            uint8_t *full = thread_buffer(1, GR * bytes);
            for (int c = 0; c < GR; c++) memcpy(full + c * bytes, first + (c < n ? c : n - 1) * bytes, bytes);
            decode_group(w->fmt[p], &f, full, bytes, K, q, d, m, NULL, 0);
        }
#ifdef MB_AMX
        uint8_t *scaled = amx_decoded ? thread_buffer(2, 3 * GR * K) : NULL;
        if (amx_decoded && f.values == 256) amx_scaled(fmt, q, (const struct kscales *)d, K, scaled);
        else if (amx_decoded) amx_signed(q, K, f.offset, scaled);
#endif
        /* a decoded group of 32-value blocks goes 4 rows at a time: at 256 rows 0.87-0.98x with 8 */
        for (int64_t r = 0, rows_here; r < mm->M; r += rows_here) {
            int on_amx = (amx || amx_decoded) && mm->M - r >= 8; /* 16 rows at a time; fewer left go as before */
            int64_t most = on_amx ? 16 : as_loaded || f.values == 256 ? TR : 4;
            rows_here = mm->M - r < most ? mm->M - r : most;
            if (!on_amx && rows_here < most && rows_here > 4) rows_here = 4; /* 8, 4 or fewer */
            float *out = to_part ? part : y + r * mm->N;
            int64_t ld = to_part ? GR : mm->N;
            if (on_amx) {
#ifdef MB_AMX
                struct acts x = acts_row(mm->a, r, K);
                if (amx_decoded && f.values == 256)
                    amx_ktile(fmt, x, scaled, (const struct kscales *)d, K, rows_here, out, ld);
                else if (amx_decoded)
                    amx_tile(x, scaled, d, m, K, f.min, rows_here, out, ld);
                else
                    amx_q8(fmt, &f, x, first, K, rows_here, out, ld, next, r == 0 ? ahead : 0);
#endif
            } else if (as_loaded) { /* only where packed, with AVX2 */
#ifdef MB_AVX2
                /* each pass of TR rows over the group fetches its share of the next one (the first pass all
                 * of it: 16-row steps on the 1.5B shape 1.10x slower) */
                int64_t passes = (mm->M + TR - 1) / TR, share = (ahead + passes - 1) / passes;
                int64_t at = r / TR * share, here = ahead - at < share ? ahead - at : share;
                tile_packed_any(fmt, &f, &mm->a, r, first, K, rows_here, out, ld, next + at, here > 0 ? here : 0);
#endif
            } else {
                tile_any(&f, &mm->a, r, q, d, m, K, rows_here, out, ld);
            }
            if (to_part) put_rows(y + r * mm->N, mm->N, part, rows_here, n, mm->stream);
        }
    }
#ifdef MB_AVX2
    if (mm->stream) _mm_sfence(); /* the streamed stores seen before the job is done */
#endif
#ifdef MB_AMX
    if (mm->amx) _tile_release();
#endif
}

/* An output this large (an lm_head's logits for many rows) leaves the caches before it is read: its
 * stores go past them, with no read of each line before it is written. */
#define STREAM_BYTES (8 << 20)

/* Whether matmuls use the tile unit (AMX) where they have enough rows. */
int mb_amx(void) {
#ifdef MB_AMX
    return amx_allowed();
#else
    return 0;
#endif
}

/* y[M, N] = x[M, K] @ w.T, x's rows quantized to int8 blocks; N is the parts' rows together. */
void mb_matmul(const float *x, const struct weight *w, float *y, int64_t M, int64_t K) {
    struct matmul mm = {.x = x, .w = w, .y = y, .M = M, .K = K};
    for (int p = 0; p < w->parts; p++) {
        mm.first[p] = mm.groups;
        mm.groups += (w->n[p] + GR - 1) / GR;
        mm.N += w->n[p];
    }
    mm.first[w->parts] = mm.groups;
    if (M == 0 || mm.N == 0) return;
    mm.stream = M * mm.N * (int64_t)sizeof(float) >= STREAM_BYTES;
#ifdef MB_AMX
    mm.amx = M >= AMX_ROWS && amx_allowed();
#endif
    int64_t padded = (M + 15) / 16 * 16; /* the tile unit reads activations 16 rows at a time */
    int blocks32 = 0, blocks256 = 0, parts = 4 * omp_get_max_threads();
    for (int p = 0; p < w->parts; p++) {
        struct format f;
        if (format_of(w->fmt[p] % PACKED, &f) && f.values == 256) blocks256 = 1;
        else blocks32 = 1;
    }
    if (blocks32) {
        mm.a.q = malloc(padded * K);
        mm.a.s = malloc(sizeof(float) * M * (K / 32) * 2);
        mm.a.sm = mm.a.s + M * (K / 32);
        mm.a.o = malloc(sizeof(int32_t) * M * (K / 32));
    }
    if (blocks256) {
        mm.a.kq = malloc(padded * K);
        mm.a.ks = malloc(sizeof(float) * M * (K / 256));
        mm.a.ko = malloc(sizeof(int32_t) * M * (K / 16 + K / 64));
        mm.a.kp = mm.a.ko + M * (K / 16);
    }
    mm.rows_per_task = (M + parts - 1) / parts;
    mm.groups_per_task = (mm.groups + parts - 1) / parts;
    int64_t tasks = (mm.groups + mm.groups_per_task - 1) / mm.groups_per_task, work = (M + 8) * mm.N * K;
    mm.lanes = pool_width(tasks, work);
    mm.lane_tasks = (tasks + mm.lanes - 1) / mm.lanes;
    /* quantizing an element costs about what 8 multiply-adds do */
    pool_run(quantize_task, &mm, (M + mm.rows_per_task - 1) / mm.rows_per_task, 8 * M * K);
    pool_run(tile_task, &mm, mm.lanes * mm.lane_tasks, work);
    free(mm.a.q);
    free(mm.a.s);
    free(mm.a.o);
    free(mm.a.kq);
    free(mm.a.ks);
    free(mm.a.ko);
}

/* Rows ids[i] (ids NULL: rows 0..n-1) of a weight of format fmt, K wide, as fp32: out [n, K]. */
void mb_dequantize(const uint8_t *w, int64_t fmt, const int64_t *ids, int64_t n, int64_t K, float *out) {
    struct format f;
    if (!format_of(fmt, &f)) return;
    int64_t bytes = K / f.values * f.bytes;
#pragma omp parallel for schedule(static) if (n * K > (1 << 20))
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = w + (ids ? ids[i] : i) * bytes;
        uint8_t u[256];
        float d[16], m[8] = {0};
        for (int64_t b = 0; b < K / f.values; b++) {
            decode_block(fmt, row + b * f.bytes, u, d, m, 0);
            float *o = out + i * K + b * f.values;
            for (int j = 0; j < f.values; j++)
                o[j] = d[j / f.unit] * (float)(u[j] + f.offset) + (f.min ? m[j / 32] : 0.0f);
        }
    }
}

/* w[N, K] (fp32) -> MB_Q8 blocks (an fp32 scale, then 32 int8), quantized as activation rows are. */
void mb_q8_quantize(const float *w, uint8_t *out, int64_t N, int64_t K) {
    int64_t nb = K / QK;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        int8_t q[QK];
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = out + (n * nb + b) * 36;
            float scale;
            quantize_row(w + n * K + b * QK, q, &scale, QK, QK);
            memcpy(blk, &scale, 4);
            memcpy(blk + 4, q, QK);
        }
    }
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

/* ---- The KV cache's rows ----
 * A row holds one position's keys (or values) of one KV head: D fp16 (kvq 0), or q8_0 as llama.cpp
 * keeps it (kvq 1): D int8, then an fp16 scale for each 32 of them (max |x| / 127), D + D / 16 bytes
 * in all. Either is read back as fp32, a value at a time or 8 or 16 in a vector.
 * kvq 2 is kvq 0 with the keys kept as the bf16 attention reads them (D % 16 == 0, ctx a multiple of
 * KB): each KB positions' rows as D / 2 runs of KB words, a word a position's two fp16 of dims 2i, 2i + 1
 * (kv_key_at), so that a block's keys need no transposing when they are read. Values keep rows. */
#define KB 64 /* the positions attention takes at a time */

static inline int q8_rows(int64_t kvq) { return kvq == 1; }

static inline int64_t kv_row_bytes(int64_t D, int64_t kvq) { return q8_rows(kvq) ? D + D / 16 : 2 * D; }

/* The byte of a kvq 2 key cache where position t's dim d lies, from its head's first position. */
static inline int64_t kv_key_at(int64_t t, int64_t d, int64_t D) {
    return t / KB * KB * 2 * D + (d / 2 * KB + t % KB) * 4 + d % 2 * 2;
}

static inline float kv_scale(const uint8_t *row, int64_t d, int64_t D) { return half_at(row + D + 2 * (d / QK)); }

static inline float kv_at(const uint8_t *row, int64_t d, int64_t D, int64_t kvq) {
    return q8_rows(kvq) ? (float)(int8_t)row[d] * kv_scale(row, d, D) : half_at(row + 2 * d);
}

#ifdef MB_F16C
static inline __m256 kv8(const uint8_t *row, int64_t d, int64_t D, int64_t kvq) {
    if (!q8_rows(kvq)) return load_h8((const uint16_t *)(row + 2 * d));
    __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + d))));
    return _mm256_mul_ps(x, _mm256_set1_ps(kv_scale(row, d, D)));
}
#endif
#if defined(__AVX512F__) && defined(MB_F16C)
static inline __m512 kv16(const uint8_t *row, int64_t d, int64_t D, int64_t kvq) {
    if (!q8_rows(kvq)) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * d)));
    __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d))));
    return _mm512_mul_ps(x, _mm512_set1_ps(kv_scale(row, d, D)));
}
#endif

/* x as fp16 (rounded to nearest even) at p, which need not be aligned: half_at's inverse. */
static inline void half_to(uint8_t *p, float x) {
    uint16_t h = f2h(x);
    memcpy(p, &h, 2);
}

/* Store row x[D] as a cache row: fp16, or q8_0 (quantize_row's int8 blocks of 32, each scale kept
 * as fp16, as ggml's q8_0). */
static void kv_store_row(const float *x, uint8_t *row, int64_t D, int64_t kvq) {
    if (q8_rows(kvq)) {
        float scales[D / QK];
        quantize_row(x, (int8_t *)row, scales, D, QK);
        for (int64_t b = 0; b < D / QK; b++) half_to(row + D + 2 * b, scales[b]);
        return;
    }
    for (int64_t i = 0; i < D; i++) half_to(row + 2 * i, x[i]);
}

/* Keys or values of M rows into one layer's cache [slots, KVH, ctx, row]: row m's KVH heads of D at
 * x + m * ld, stored at slot slots[m], position positions[m]. kvq 2 is for keys only (values: kvq 0). */
void mb_kv_store(const float *x, int64_t ld, uint8_t *cache, const int64_t *slots, const int64_t *positions,
                 int64_t M, int64_t KVH, int64_t D, int64_t ctx, int64_t kvq) {
    int64_t RB = kv_row_bytes(D, kvq);
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < KVH; h++) {
            uint8_t *head = cache + (slots[m] * KVH + h) * ctx * RB;
            const float *row = x + m * ld + h * D;
            if (kvq == 2)
                for (int64_t d = 0; d < D; d++) half_to(head + kv_key_at(positions[m], d, D), row[d]);
            else
                kv_store_row(row, head + positions[m] * RB, D, kvq);
        }
}

void mb_chunk_attention(const float *q, int64_t ldq, const uint8_t *k, const uint8_t *v, const int64_t *rows,
                        const int64_t *ns, const int64_t *slots, const int64_t *starts, float *out, int64_t R,
                        int64_t H, int64_t KVH, int64_t D, int64_t ctx, float scale, int64_t bf16, int64_t kvq,
                        int64_t window, float softcap);

/* cap tanh(s / cap): a score softly capped (Gemma 2's), tanh as (1 - e) / (1 + e) with e = exp(-2|s| / cap). */
static inline float capped(float s, float cap) {
    float e = expf(fabsf(s) * (-2.0f / cap));
    return copysignf(cap * ((1.0f - e) / (1.0f + e)), s);
}

/* Decode attention for one (row, query head), a task of mb_decode_attention where D % 16 != 0
 * (an fp16 cache: q8_0 rows need D % 32 == 0). */
struct heads {
    const float *q;
    int64_t ldq;
    const uint16_t *k, *v;
    const int64_t *rows, *slots, *lens;
    float *out;
    int64_t H, KVH, D, ctx;
    float scale, softcap;
    int64_t max_len, window;
    float *scores[MAX_THREADS];
};

static void head_task(void *arg, int64_t i, int who) {
    struct heads *a = arg;
    int64_t H = a->H, KVH = a->KVH, D = a->D, r = i / H, h = i % H, len = a->lens[r], g = h / (H / KVH);
    if (!a->scores[who]) a->scores[who] = malloc(sizeof(float) * a->max_len);
    float *p = a->scores[who], *o = a->out + (a->rows[r] * H + h) * D, top = -INFINITY, sum = 0.0f;
    const float *qi = a->q + a->rows[r] * a->ldq + h * D;
    const uint16_t *kb = a->k + (a->slots[r] * KVH + g) * a->ctx * D, *vb = a->v + (a->slots[r] * KVH + g) * a->ctx * D;
    int64_t from = a->window && len > a->window ? len - a->window : 0;
    kb += from * D;
    vb += from * D;
    len -= from;
    for (int64_t t = 0; t < len; t++) {
        p[t] = dot_h(qi, kb + t * D, D) * a->scale;
        if (a->softcap > 0) p[t] = capped(p[t], a->softcap);
        top = fmaxf(top, p[t]);
    }
    for (int64_t t = 0; t < len; t++) sum += (p[t] = expf(p[t] - top));
    memset(o, 0, sizeof(float) * D);
    for (int64_t t = 0; t < len; t++) axpy_h(o, p[t] / sum, vb + t * D, D);
}

/* One query row per request over its own slot's keys and values.
 * q: rows of H heads of D (row stride ldq); out: [rows, H, D]; k, v: one layer's cache
 * [slots, KVH, ctx, row] (each head's positions contiguous; rows as kvq says); for each of R requests,
 * rows[r] is its query row, slots[r] its slot and lens[r] how many positions it attends to (the
 * last `window` of them where window > 0: sliding-window attention).
 * Where D % 16 == 0, a row is a chunk of one (mb_chunk_attention below, bf16 as there): the query
 * heads of a KV head share each key, converted once, instead of each head reading the cache
 * again; otherwise each head multiplies in fp32. */
void mb_decode_attention(const float *q, int64_t ldq, const uint8_t *k, const uint8_t *v, const int64_t *rows,
                         const int64_t *slots, const int64_t *lens, float *out, int64_t R, int64_t H,
                         int64_t KVH, int64_t D, int64_t ctx, float scale, int64_t bf16, int64_t kvq,
                         int64_t window, float softcap) {
    if (D % 16 == 0) {
        int64_t *ns = malloc(sizeof(int64_t) * R * 2), *starts = ns + R;
        for (int64_t r = 0; r < R; r++) {
            ns[r] = 1;
            starts[r] = lens[r] - 1;
        }
        mb_chunk_attention(q, ldq, k, v, rows, ns, slots, starts, out, R, H, KVH, D, ctx, scale, bf16, kvq, window,
                           softcap);
        free(ns);
        return;
    }
    struct heads a = {q, ldq, (const uint16_t *)k, (const uint16_t *)v, rows, slots, lens, out, H, KVH, D, ctx, scale,
                      softcap, 1, window, {0}};
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
 * the CPU has AVX512-BF16: MB_BF16 below), scores by a register tile (or the tile unit's, where it
 * has AMX-BF16: MB_AMX_BF16), an online softmax per row in fp32, and the weighted values added (the
 * same). A row's operations depend only on its
 * position and its cache, never on the chunk, the task or the thread around it. With a sliding
 * window of W, row p sees positions p-W+1..p: the earlier ones of a block score -inf, and a block
 * with none of them is passed by as a block past its position is. Blocks are KB positions (above). */
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
#define vabs(x) _mm512_abs_ps(x)
#define vsigned(t, x) /* t with x's sign (t >= 0) */                                      \
    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t),                               \
                                        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN))))
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
#define vabs(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)
#define vsigned(t, x) /* t with x's sign (t >= 0) */ _mm256_or_ps(t, _mm256_and_ps(x, _mm256_set1_ps(-0.0f)))
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

/* A block's KB scores capped (cap > 0), each the same way wherever it lies. */
static void cap_block(float *s, float cap) {
#ifdef VW
    for (int64_t j = 0; j < KB; j += VW) {
        vecf x = vload(s + j), e = vexp(vmul(vabs(x), vset(-2.0f / cap)));
        vstore(s + j, vsigned(vmul(vset(cap), vdiv(vsub(vset(1.0f), e), vadd(vset(1.0f), e))), x));
    }
#else
    for (int64_t j = 0; j < KB; j++) s[j] = capped(s[j], cap);
#endif
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

/* k, v: the block's first cache rows (RB bytes apart, as kvq says); tmp: KB * D / 2 words of scratch. */
static void pack_block_bf16(const uint8_t *k, const uint8_t *v, int64_t n, int64_t D, int64_t RB, int64_t kvq,
                            uint32_t *kp, uint32_t *vp, uint32_t *tmp) {
    int64_t D2 = D / 2;
    if (kvq == 2) { /* the keys as kp takes them already: only made bf16, positions past n zero */
        for (int64_t i = 0; i < D2 * KB; i += 16) {
            __mmask16 in = (__mmask16)(n - i % KB >= 16 ? 0xFFFF : n > i % KB ? (1u << (n - i % KB)) - 1 : 0);
            __m512i w = _mm512_maskz_loadu_epi32(in, k + 4 * i); /* 16 words: 16 positions' two fp16 */
            __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(w));
            __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));
            _mm512_storeu_si512(kp + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    } else { /* rows: made bf16, then transposed */
        for (int64_t t = 0; t < KB; t++)
            for (int64_t d = 0; d < D; d += 16) {
                __m256i w = _mm256_setzero_si256();
                if (t < n) w = bf16_row(kv16(k + t * RB, d, D, kvq));
                _mm256_storeu_si256((__m256i *)(tmp + t * D2 + d / 2), w);
            }
        for (int64_t t = 0; t < KB; t += 8)
            for (int64_t d = 0; d < D2; d += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps((const float *)(tmp + (t + i) * D2 + d));
                transpose8(r);
                for (int i = 0; i < 8; i++) _mm256_storeu_ps((float *)(kp + (d + i) * KB + t), r[i]);
            }
    }
    for (int64_t t = 0; t < n; t += 2)
        for (int64_t d = 0; d < D; d += 16) {
            __m512 even = kv16(v + t * RB, d, D, kvq), odd = vzero();
            if (t + 1 < n) odd = kv16(v + (t + 1) * RB, d, D, kvq);
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

/* The weights p of `rows` rows (KB each) as bf16 pairs pw [rows][KB / 2], as the values' products take them. */
static inline void weights_bf16(const float *p, uint32_t *pw, int64_t rows) {
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < KB; j += 32)
            _mm512_storeu_si512(pw + r * (KB / 2) + j / 2,
                                (__m512i)_mm512_cvtne2ps_pbh(vload(p + r * KB + j + 16), vload(p + r * KB + j)));
}

/* o[m + r] += p[m + r] . vp over the first n positions, for four rows (weights past a row's own
 * count are zero). */
static void block_values4_bf16(const float *p, const uint32_t *vp, float *o, int64_t n, int64_t D) {
    uint32_t pw[4][KB / 2];
    weights_bf16(p, pw[0], 4);
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
 * k, v point at the block's first cache row of one KV head (rows RB bytes apart, as kvq says). */
static void widen_block(const uint8_t *k, const uint8_t *v, int64_t n, int64_t D, int64_t RB, int64_t kvq,
                        float *kt, float *vb) {
    if (kvq == 2) { /* the bf16 attention's keys, read here a value at a time (fp32 attention over them) */
        for (int64_t t = 0; t < KB; t++)
            for (int64_t d = 0; d < D; d++) kt[d * KB + t] = t < n ? half_at(k + kv_key_at(t, d, D)) : 0.0f;
        for (int64_t t = 0; t < n; t++)
            for (int64_t d = 0; d < D; d++) vb[t * D + d] = half_at(v + t * RB + 2 * d);
        return;
    }
#ifdef VW
    for (int64_t t = 0; t < KB; t += 8)
        for (int64_t d = 0; d < D; d += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = t + i < n ? kv8(k + (t + i) * RB, d, D, kvq) : _mm256_setzero_ps();
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(kt + (d + i) * KB + t, r[i]);
        }
    for (int64_t t = 0; t < n; t++)
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(vb + t * D + d, kv8(v + t * RB, d, D, kvq));
#else
    for (int64_t t = 0; t < KB; t++)
        for (int64_t d = 0; d < D; d++) kt[d * KB + t] = t < n ? kv_at(k + t * RB, d, D, kvq) : 0.0f;
    for (int64_t t = 0; t < n; t++)
        for (int64_t d = 0; d < D; d++) vb[t * D + d] = kv_at(v + t * RB, d, D, kvq);
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

#if defined(MB_AMX) && defined(MB_BF16) && defined(__AMX_BF16__)
#define MB_AMX_BF16 1
/* Where the tile unit multiplies bf16 too, attention's dot products go to it (D % 32 == 0), rows 16 at a time
 * (a call's rows padded to 16s): every row of every call, so that a row's bits still depend only on its
 * position and its cache (the vector unit's sums, in another order, would give others). Prompt rows 3.1-3.3x
 * faster (bench/attention_speed.py: qwen's heads, 256 rows at 2-8k positions), one-token rows ~1.2x. Tiles
 * (amx_configure(0)) 0-3 hold sums (16 rows x 16 fp32), 4 a 16-row tile of bf16 pairs of the rows, 5 one of
 * the keys' or values'. */

/* Tile i's scores plus the queries' tile (4) times the keys of 32 dims from 2d, positions 16i .. */
#define AMX_SCORES(i)                             \
    _tile_loadd(5, kp + d * KB + 16 * i, KB * 4); \
    _tile_dpbf16ps(i, 4, 5);

/* s[M][KB] = qb[M] . kp (block_scores_bf16's, by the tile unit), M % 16 == 0. */
static void amx_scores(const uint32_t *qb, const uint32_t *kp, float *s, int64_t M, int64_t D) {
    for (int64_t m = 0; m < M; m += 16) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t d = 0; d < D / 2; d += 16) { /* 32 dims a tile */
            _tile_loadd(4, qb + m * (D / 2) + d, D / 2 * 4);
            AMX_SCORES(0) AMX_SCORES(1) AMX_SCORES(2) AMX_SCORES(3)
        }
        _tile_stored(0, s + m * KB, KB * 4);
        _tile_stored(1, s + m * KB + 16, KB * 4);
        _tile_stored(2, s + m * KB + 32, KB * 4);
        _tile_stored(3, s + m * KB + 48, KB * 4);
    }
}

/* The sums of dims d + 16i .. of 16 rows from m: loaded into tile i from o, or stored there (op), if i < w. */
#define AMX_SUMS(i, op) \
    if (i < w) op(i, o + m * D + d + 16 * i, D * 4);

/* Tile i's sums plus the weights' tile (4) times the values of 32 positions from 32k, dims d + 16i .. */
#define AMX_VALUES(i)                                         \
    if (i < w) {                                              \
        _tile_loadd(5, vp + 16 * k * D + d + 16 * i, D * 4); \
        _tile_dpbf16ps(i, 4, 5);                              \
    }

/* o[M][D] += p[M][KB] . vp (block_values4_bf16's for all rows, by the tile unit), M % 16 == 0; pw: room for
 * the weights as bf16 pairs [M][KB / 2]. vp's pairs past the block's positions are zero. */
static void amx_values(const float *p, uint32_t *pw, const uint32_t *vp, float *o, int64_t M, int64_t D) {
    weights_bf16(p, pw, M);
    for (int64_t m = 0; m < M; m += 16)
        for (int64_t d = 0; d < D; d += 64) {
            int w = D - d >= 64 ? 4 : (int)(D - d) / 16;
            AMX_SUMS(0, _tile_loadd) AMX_SUMS(1, _tile_loadd) AMX_SUMS(2, _tile_loadd) AMX_SUMS(3, _tile_loadd)
            for (int k = 0; k < 2; k++) {
                _tile_loadd(4, pw + m * (KB / 2) + 16 * k, KB / 2 * 4);
                AMX_VALUES(0) AMX_VALUES(1) AMX_VALUES(2) AMX_VALUES(3)
            }
            AMX_SUMS(0, _tile_stored) AMX_SUMS(1, _tile_stored) AMX_SUMS(2, _tile_stored) AMX_SUMS(3, _tile_stored)
        }
}
#endif

/* The task's rows: positions p0..p0+np-1 of one chunk, each with the G query heads of KV head g,
 * whose keys and values k, v hold from position 0; bf16: multiply in bf16 pairs (only where MB_BF16
 * is built; fp32 otherwise), amx: on the tile unit (MB_AMX_BF16); window: each row sees its last
 * `window` positions only (0: all). */
static void chunk_task(const float *q, int64_t ldq, const uint8_t *k, const uint8_t *v, int64_t kvq, int64_t row0,
                       int64_t p0, int64_t np, int64_t g, int64_t G, int64_t D, float scale, float softcap,
                       float *out, int64_t ldo, float *buf, int bf16, int amx, int64_t window) {
    (void)bf16, (void)amx;
    int64_t M = np * G, Mp = amx ? (M + 15) / 16 * 16 : (M + 3) / 4 * 4, last = p0 + np - 1, RB = kv_row_bytes(D, kvq);
    float *qs = buf, *kt = qs + Mp * D, *vb = kt + D * KB, *s = vb + KB * D, *o = s + Mp * KB;
    float *max = o + Mp * D, *sum = max + Mp;
    uint32_t *pw = (uint32_t *)(sum + Mp); /* the weights as bf16 pairs, for the tile unit */
    (void)pw;
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
    int64_t first = window && p0 >= window ? (p0 - window + 1) / KB * KB : 0; /* blocks before: no row's */
    for (int64_t t0 = first; t0 <= last; t0 += KB) {
        int64_t n = last - t0 + 1 < KB ? last - t0 + 1 : KB;
        const uint8_t *kb = k + t0 * RB, *vbk = v + t0 * RB;
#ifdef MB_BF16
        if (bf16) {
            pack_block_bf16(kb, vbk, n, D, RB, kvq, (uint32_t *)kt, (uint32_t *)vb, (uint32_t *)kt + D * KB / 2);
#ifdef MB_AMX_BF16
            if (amx) { /* the tile unit reads whole blocks: the pairs past the block's positions zero */
                memset((uint32_t *)vb + (n + 1) / 2 * D, 0, sizeof(uint32_t) * (KB / 2 - (n + 1) / 2) * D);
                amx_scores((uint32_t *)qs, (uint32_t *)kt, s, Mp, D);
            } else
#endif
                block_scores_bf16((uint32_t *)qs, (uint32_t *)kt, s, Mp, D);
        } else
#endif
        {
            widen_block(kb, vbk, n, D, RB, kvq, kt, vb);
            block_scores(qs, kt, s, Mp, D);
        }
        for (int64_t m = 0; m < Mp; m += 4) {
            int64_t seen[4], most = 0;
            for (int r = 0; r < 4; r++) {
                int64_t pos = m + r < M ? p0 + (m + r) / G : last, c = pos - t0 + 1;
                int64_t before = window ? pos - window + 1 - t0 : 0; /* positions of the block out of the window */
                seen[r] = c < 0 || before >= c || before >= KB ? 0 : c > KB ? KB : c;
                most = seen[r] > most ? seen[r] : most;
                if (seen[r] > 0) {
                    if (softcap > 0) cap_block(s + (m + r) * KB, softcap);
                    for (int64_t j = 0; j < before; j++) s[(m + r) * KB + j] = -INFINITY;
                    block_softmax(s + (m + r) * KB, seen[r], max + m + r, sum + m + r, o + (m + r) * D, D);
                } else memset(s + (m + r) * KB, 0, sizeof(float) * KB);
            }
#ifdef MB_BF16
            if (bf16) {
                if (!amx) block_values4_bf16(s + m * KB, (uint32_t *)vb, o + m * D, most, D);
                continue;
            }
#endif
            block_values4(s + m * KB, vb, o + m * D, most, D);
        }
#ifdef MB_AMX_BF16
        if (amx) amx_values(s, pw, (uint32_t *)vb, o, Mp, D);
#endif
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
    const uint8_t *k, *v;
    int64_t kvq;
    const int64_t *rows, *ns, *slots, *starts;
    float *out;
    int64_t H, KVH, D, ctx;
    float scale, softcap;
    int64_t span, blocks, floats, window;
    int bf16, amx; /* amx: the dot products on the tile unit */
    float *bufs[MAX_THREADS];
};

static void chunk_attention_task(void *arg, int64_t t, int who) {
    struct chunks *a = arg;
    int64_t KVH = a->KVH, D = a->D, c = t / (KVH * a->blocks), g = t / a->blocks % KVH, first = t % a->blocks * a->span;
    if (first >= a->ns[c]) return;
    if (!a->bufs[who]) a->bufs[who] = malloc(sizeof(float) * a->floats);
    int64_t np = a->ns[c] - first < a->span ? a->ns[c] - first : a->span;
    int64_t base = (a->slots[c] * KVH + g) * a->ctx * kv_row_bytes(D, a->kvq);
#ifdef MB_AMX_BF16
    if (a->amx) amx_configure(0);
#endif
    chunk_task(a->q, a->ldq, a->k + base, a->v + base, a->kvq, a->rows[c] + first, a->starts[c] + first, np, g, a->H / KVH, D,
               a->scale, a->softcap, a->out, a->H * D, a->bufs[who], a->bf16, a->amx, a->window);
#ifdef MB_AMX_BF16
    if (a->amx) _tile_release();
#endif
}

/* R prompt chunks, each attending over its own slot: chunk c's rows are rows[c]..rows[c]+ns[c]-1 of q
 * (H heads of D, row stride ldq), at positions starts[c].. of slot slots[c]; out: [rows, H * D].
 * k, v: one layer's cache [slots, KVH, ctx, row], rows fp16 (kvq 0), q8_0 (kvq 1, D % 32 == 0), or fp16
 * with the keys in blocks (kvq 2: the bf16 attention's form, ctx a multiple of KB).
 * D % 16 == 0. bf16: multiply in bf16 pairs where this build can (mb_attention_bf16), else in fp32.
 * window > 0: each row attends to its last `window` positions (itself included) only. softcap > 0: each
 * score (after the scale) becomes softcap tanh(score / softcap) before the softmax (Gemma 2). */
void mb_chunk_attention(const float *q, int64_t ldq, const uint8_t *k, const uint8_t *v, const int64_t *rows,
                        const int64_t *ns, const int64_t *slots, const int64_t *starts, float *out, int64_t R,
                        int64_t H, int64_t KVH, int64_t D, int64_t ctx, float scale, int64_t bf16, int64_t kvq,
                        int64_t window, float softcap) {
    int64_t G = H / KVH, longest = 1, threads = omp_get_max_threads(), work = 0;
    for (int64_t c = 0; c < R; c++) {
        longest = ns[c] > longest ? ns[c] : longest;
        work += 2 * ns[c] * (starts[c] + ns[c]) * H * D;
    }
    int64_t span = ROWS / G > 1 ? ROWS / G : 1, wanted = (4 * threads + R * KVH - 1) / (R * KVH);
    if ((longest + span - 1) / span < wanted) span = (longest + wanted - 1) / wanted;
    int amx = 0;
#ifdef MB_AMX_BF16
    amx = bf16 && D % 32 == 0 && amx_allowed();
#endif
    int64_t blocks = (longest + span - 1) / span, Mp = amx ? (span * G + 15) / 16 * 16 : (span * G + 3) / 4 * 4;
    struct chunks a = {q, ldq, k, v, kvq, rows, ns, slots, starts, out, H, KVH, D, ctx, scale, softcap, span, blocks,
                       Mp * D * 2 + D * KB * 2 + Mp * KB * 3 / 2 + Mp * 2, window, bf16 != 0, amx, {0}};
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

/* The first index of a row's largest value (NaN never is; a row of -inf or NaN gives 0): the largest
 * of each block of 256 in vectors, then the block that first holds the row's largest read for it. */
#define ARGMAX_BLOCK 256

static int64_t argmax_row(const float *x, int64_t n) {
    float best = -INFINITY;
    int64_t from = 0, i = 0;
#ifdef VW
    for (; i + ARGMAX_BLOCK <= n; i += ARGMAX_BLOCK) {
        vecf top = vset(-INFINITY);
        for (int64_t j = i; j < i + ARGMAX_BLOCK; j += VW) top = vmax(vload(x + j), top); /* NaN: keeps top */
        float t = vhmax(top);
        if (t > best) {
            best = t;
            from = i;
        }
    }
#endif
    for (int64_t j = i; j < n; j++)
        if (x[j] > best) {
            best = x[j];
            from = j;
        }
    for (int64_t j = from; j < n; j++)
        if (x[j] == best) return j;
    return 0;
}

struct argmax {
    const float *x;
    int64_t N, *out;
};

static void argmax_task(void *arg, int64_t m, int who) {
    (void)who;
    struct argmax *a = arg;
    a->out[m] = argmax_row(a->x + m * a->N, a->N);
}

/* out[m] = the first index of row m's largest value, x [M, N]. */
void mb_argmax(const float *x, int64_t M, int64_t N, int64_t *out) {
    struct argmax a = {x, N, out};
    pool_run(argmax_task, &a, M, M * N);
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

/* out[m, i] = gelu(gu[m, i]) * gu[m, I + i], GELU's tanh form (Gemma's gelu_pytorch_tanh), taken as
 * g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)), the sigmoid as in mb_silu_mul. */
void mb_gelu_mul(const float *gu, float *out, int64_t M, int64_t I) {
    const float c = 2.0f * 0.7978845608028654f, k = 0.044715f;
    for (int64_t m = 0; m < M; m++) {
        const float *gate = gu + m * 2 * I, *up = gate + I;
        int64_t i = 0;
#ifdef VW
        for (; i + VW <= I; i += VW) {
            vecf g = vload(gate + i), t = vmul(vset(c), vadd(g, vmul(vset(k), vmul(g, vmul(g, g)))));
            vecf sig = vdiv(vexp(vmin(t, vzero())), vadd(vset(1.0f), vexp(vmin(t, vsub(vzero(), t)))));
            vstore(out + m * I + i, vmul(vmul(g, sig), vload(up + i)));
        }
#endif
        for (; i < I; i++) {
            float g = gate[i], t = c * (g + k * (g * (g * g)));
            out[m * I + i] = g * (expf(fminf(t, 0.0f)) / (1.0f + expf(-fabsf(t)))) * up[i];
        }
    }
}

static void add_rows(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* x[0..n) times s (Granite's residual scale), as torch multiplies: nothing where s is 1. */
static void scale_rows(float *x, int64_t n, float s) {
    for (int64_t i = 0; s != 1.0f && i < n; i++) x[i] *= s;
}

/* One decoder layer for M rows, x [M, D] updated in place: the same kernels, in the same order,
 * as the runner's general path, so a row's result is the same either way (weights as mb_matmul takes them). Keys and values of each row are stored
 * at its slot and position; it attends over positions 0..pos (the last `window` of them where window > 0).
 * Optional (NULL: none): per-head norms of queries and keys before the rotary, norms of the attention's
 * and the MLP's outputs (Gemma); gelu: GELU (tanh form) in the MLP, else SiLU; residual: what those outputs
 * are multiplied by before they are added (Granite's; 1 for the others); softcap > 0: attention scores are
 * capped softly to it (Gemma 2's). Rows of one slot at consecutive
 * positions attend as one prompt chunk (mb_chunk_attention, which gives a row the same result in
 * any chunk; one-token rows are chunks of one, as in mb_decode_attention); where HD % 16 != 0
 * each row attends alone (mb_decode_attention's fp32 heads). */
void mb_layer(float *x, int64_t M, int64_t D, int64_t I, int64_t H, int64_t KVH, int64_t HD,
              float eps, float scale, const float *ln_attn, const struct weight *qkv_w,
              const float *qkv_bias, const struct weight *o_w, const float *ln_mlp,
              const struct weight *gu_w, const struct weight *down_w, const int64_t *slots, const int64_t *positions, const float *cos, const float *sin,
              uint8_t *kcache, uint8_t *vcache, int64_t ctx, int64_t bf16, int64_t kvq, int64_t window,
              const float *q_norm, const float *k_norm, const float *post_attn, const float *post_mlp, int64_t gelu,
              float residual, float softcap) {
    int64_t ld = (H + 2 * KVH) * HD, wide = D > I ? D : I, n = 0; /* chunks */
    float *h = malloc(sizeof(float) * M * wide), *qkv = malloc(sizeof(float) * M * ld);
    float *attn = malloc(sizeof(float) * M * H * HD), *gu = malloc(sizeof(float) * M * (2 * I > D ? 2 * I : D));
    int64_t *rows = malloc(sizeof(int64_t) * M * 4), *ns = rows + M, *cslots = ns + M, *starts = cslots + M;
    mb_rms_norm(x, ln_attn, h, M, D, eps);
    mb_matmul(h, qkv_w, qkv, M, D);
    if (qkv_bias)
        for (int64_t m = 0; m < M; m++) add_rows(qkv + m * ld + 0, qkv_bias, ld);
    for (int64_t m = 0; q_norm && m < M; m++) mb_rms_norm(qkv + m * ld, q_norm, qkv + m * ld, H, HD, eps);
    for (int64_t m = 0; k_norm && m < M; m++) mb_rms_norm(qkv + m * ld + H * HD, k_norm, qkv + m * ld + H * HD, KVH, HD, eps);
    mb_rope(qkv, ld, positions, cos, sin, M, H + KVH, HD);
    mb_kv_store(qkv + H * HD, ld, kcache, slots, positions, M, KVH, HD, ctx, kvq);
    mb_kv_store(qkv + (H + KVH) * HD, ld, vcache, slots, positions, M, KVH, HD, ctx, q8_rows(kvq)); /* values: rows */
    for (int64_t m = 0; m < M; m++) {
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
        mb_chunk_attention(qkv, ld, kcache, vcache, rows, ns, cslots, starts, attn, n, H, KVH, HD, ctx, scale, bf16, kvq,
                           window, softcap);
    } else { /* each row over its position + 1 keys */
        for (int64_t m = 0; m < M; m++) {
            rows[m] = m;
            starts[m] = positions[m] + 1;
        }
        mb_decode_attention(qkv, ld, kcache, vcache, rows, slots, starts, attn, M, H, KVH, HD, ctx, scale, bf16, kvq,
                            window, softcap);
    }
    mb_matmul(attn, o_w, h, M, H * HD);
    if (post_attn) mb_rms_norm(h, post_attn, h, M, D, eps);
    scale_rows(h, M * D, residual);
    add_rows(x, h, M * D);
    mb_rms_norm(x, ln_mlp, h, M, D, eps);
    mb_matmul(h, gu_w, gu, M, D);
    (gelu ? mb_gelu_mul : mb_silu_mul)(gu, h, M, I);
    mb_matmul(h, down_w, gu, M, I);
    if (post_mlp) mb_rms_norm(gu, post_mlp, gu, M, D, eps);
    scale_rows(gu, M * D, residual);
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

/* 1 where attention's bf16 products run on the tile unit (AMX-BF16; heads of a multiple of 32 values). */
int mb_attention_amx(void) {
#ifdef MB_AMX_BF16
    return amx_allowed();
#else
    return 0;
#endif
}
