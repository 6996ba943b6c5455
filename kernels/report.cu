// The manager's step report (canary/manager/mailbox.py, CudaMailbox), compiled by NVRTC through CuPy.
//
// One block copies the report block (every group's ring write index, counters, plan status and ring) and the
// step's req_pool_indices into the next slot of a mailbox in pinned host memory, which the kernel writes
// directly (pinned memory is mapped into the device's address space under unified addressing), then clears the
// ring write indexes for the next step, then publishes the slot by writing its sequence number last. The host
// polls that word: no device-to-host copy, memset, event record or event query per step, and the launch can sit
// inside the CUDA graph the manager replays for an eager step (canary/manager/eager.py), because the slot is
// chosen on the device from a counter. Why no Numba twin: this is the manager's plumbing, not part of the
// planner or canary contract, and a Numba launch costs the host more than the copies it would replace (the
// manager's mailbox copies there instead: CudaMailbox without a report kernel).

// ReportParams, REPORT_THREADS and the slot layout (REPORT_SLOT_HEADER_WORDS) come from canary_constants.cuh,
// generated from canary/contract/report_layout.py.
#include "canary_constants.cuh"

extern "C" __global__ void __launch_bounds__(REPORT_THREADS) canary_report(const ReportParams p) {
    __shared__ i64 s_seq;
    // Atomic: reports launched on two streams may run at once (the host orders them, canary/manager/mailbox.py
    // order_report, but a lost increment would desynchronize every later slot).
    if (threadIdx.x == 0) s_seq = (i64)atomicAdd(reinterpret_cast<unsigned long long*>(p.counter), 1ull) + 1;
    __syncthreads();
    const i64 seq = s_seq;
    i64* slot = p.mailbox + (seq % p.slots) * p.slot_words;
    for (i64 i = threadIdx.x; i < p.words; i += blockDim.x) slot[REPORT_SLOT_HEADER_WORDS + i] = p.block[i];
    for (i64 i = threadIdx.x; i < p.bs; i += blockDim.x) slot[REPORT_SLOT_HEADER_WORDS + p.words + i] = p.rpi[i];
    __syncthreads();  // every read of the write indexes is done before they are cleared
    i64* block = const_cast<i64*>(p.block);
    for (i64 i = threadIdx.x; i < p.index_words; i += blockDim.x) block[i] = 0;
    __threadfence_system();  // this thread's slot stores reach the host before the sequence number
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        *reinterpret_cast<volatile i64*>(slot) = seq;
    }
}
