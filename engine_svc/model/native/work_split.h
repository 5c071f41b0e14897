/*
 * A parallel region's work items in one contiguous run per thread, with a delayed
 * thread's remaining items handed over to the others.
 *
 *   thread 0's run           thread 1's run
 *   [front ->      <- back]  [front ->      <- back]
 *    owner takes    thieves    owner takes    thieves
 *
 * A thread takes its own items front to back, so each item's weights follow the previous
 * one's in memory and the prefetch a tile issues for "the next slice" warms the panel the
 * same thread computes next (items dealt alternately from one shared counter left every
 * panel cold: the other thread had prefetched it into its own cache). A thread whose run
 * is empty takes the others' remaining items from the back, one at a time: a thread the OS
 * takes off its core for a time slice hands its work over instead of holding up the
 * region's end. Which thread computes an item never changes its result: an item is whole
 * output tiles, computed by one thread.
 *
 * A run's (front, back) is one 64-bit word changed by compare-and-swap, so an item is
 * taken exactly once; runs are a cache line apart, so an owner's takes do not contend
 * with another owner's.
 */
#ifndef TANDEM_WORK_SPLIT_H
#define TANDEM_WORK_SPLIT_H

#include <stdint.h>
#include <stdlib.h>

typedef struct {
    uint64_t span; /* back << 32 | front: the run's items not yet taken are [front, back) */
    char pad[56];
} tk_run;

/* n runs, run t of length len(t) set by the caller with tk_run_set; NULL if out of memory. */
static inline tk_run *tk_runs_new(int n) { return aligned_alloc(64, sizeof(tk_run) * (size_t)(n > 0 ? n : 1)); }

static inline void tk_run_set(tk_run *r, int len) { __atomic_store_n(&r->span, (uint64_t)len << 32, __ATOMIC_RELAXED); }

/* The run's next item from the front (back = 0) or the back (back = 1), or -1 if none is left. */
static inline int tk_run_take(tk_run *r, int back) {
    uint64_t old = __atomic_load_n(&r->span, __ATOMIC_RELAXED);
    for (;;) {
        const uint32_t f = (uint32_t)old, b = (uint32_t)(old >> 32);
        if (f >= b) return -1;
        const uint64_t next = back ? (uint64_t)(b - 1) << 32 | f : (uint64_t)b << 32 | (f + 1);
        if (__atomic_compare_exchange_n(&r->span, &old, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return (int)(back ? b - 1 : f);
    }
}

/* Thread t's next item as (run, index in the run): its own run's front, then the other
 * runs' backs, in turn from t + 1. Returns 0 when every run is empty. Runs only shrink, so
 * a run found empty stays empty. */
static inline int tk_runs_next(tk_run *runs, int n, int t, int *run, int *index) {
    for (int j = 0; j < n; j++) {
        const int v = (t + j) % n, i = tk_run_take(&runs[v], j != 0);
        if (i >= 0) {
            *run = v, *index = i;
            return 1;
        }
    }
    return 0;
}

#endif
