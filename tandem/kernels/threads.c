/* The OpenMP thread count of the calling thread, for the kernels' parallel regions.
 *
 * OpenMP keeps the count per thread: a thread that torch has not yet run a parallel operator on
 * (the server's engine thread, at its first step) starts from the default, one per core, not
 * from torch.set_num_threads. native.py sets it from torch's count before each thread's first
 * kernel call, so --threads holds for the kernels too. */
#include <omp.h>

void tandem_set_threads(int n) { omp_set_num_threads(n); }

int tandem_threads(void) { return omp_get_max_threads(); }
