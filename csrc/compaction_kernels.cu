// Vectorised gather/scatter of kept KV rows; see compaction_kernels.cuh.
#include "compaction_kernels.cuh"

namespace kvevict {
namespace {

constexpr int kThreads = 256;

template <int kBytes>
struct VectorOf;
template <>
struct VectorOf<16> { using type = uint4; };
template <>
struct VectorOf<8> { using type = uint2; };
template <>
struct VectorOf<4> { using type = uint32_t; };
template <>
struct VectorOf<2> { using type = uint16_t; };
template <>
struct VectorOf<1> { using type = uint8_t; };

// One thread copies one vector of one plane of one move's row; a grid-stride loop covers any size.
template <int kBytes, bool kGather>
__global__ void move_rows_kernel(const int64_t* __restrict__ cache_ptrs, const int64_t* __restrict__ slots,
                                 const int64_t* __restrict__ layers, char* __restrict__ buffer,
                                 int64_t num_moves, RowLayout layout) {
  using Vec = typename VectorOf<kBytes>::type;
  const int64_t vectors_per_row = layout.row_bytes / kBytes;
  const int64_t total = num_moves * layout.num_planes * vectors_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t vector = i % vectors_per_row;
    const int64_t row = i / vectors_per_row;  // (move, plane) pair, also the buffer row
    const int64_t plane = row % layout.num_planes;
    const int64_t move = row / layout.num_planes;
    const int64_t slot = __ldg(slots + move);
    char* cache = reinterpret_cast<char*>(__ldg(cache_ptrs + __ldg(layers + move)));
    Vec* cache_vec = reinterpret_cast<Vec*>(cache + (slot / layout.block_size) * layout.subblock_stride +
                                            (slot % layout.block_size) * layout.token_stride +
                                            plane * layout.plane_stride) + vector;
    Vec* buffer_vec = reinterpret_cast<Vec*>(buffer + row * layout.row_bytes) + vector;
    if (kGather) {
      *buffer_vec = *cache_vec;
    } else {
      *cache_vec = *buffer_vec;
    }
  }
}

template <int kBytes>
cudaError_t launch(const int64_t* cache_ptrs, const int64_t* slots, const int64_t* layers, void* buffer,
                   int64_t num_moves, const RowLayout& layout, bool gather, cudaStream_t stream) {
  const int64_t total = num_moves * layout.num_planes * (layout.row_bytes / kBytes);
  // enough blocks to fill any current GPU; the grid-stride loop does the rest
  const int blocks = static_cast<int>(total / kThreads + 1 < 65536 ? total / kThreads + 1 : 65536);
  char* staging = static_cast<char*>(buffer);
  if (gather) {
    move_rows_kernel<kBytes, true><<<blocks, kThreads, 0, stream>>>(cache_ptrs, slots, layers, staging,
                                                                     num_moves, layout);
  } else {
    move_rows_kernel<kBytes, false><<<blocks, kThreads, 0, stream>>>(cache_ptrs, slots, layers, staging,
                                                                      num_moves, layout);
  }
  return cudaGetLastError();
}

}  // namespace

int pick_vector_bytes(const RowLayout& layout, const int64_t* host_cache_ptrs, int64_t num_caches,
                      uint64_t buffer_ptr) {
  uint64_t bits = static_cast<uint64_t>(layout.row_bytes) | static_cast<uint64_t>(layout.plane_stride) |
                  static_cast<uint64_t>(layout.subblock_stride) | static_cast<uint64_t>(layout.token_stride) |
                  buffer_ptr;
  for (int64_t i = 0; i < num_caches; ++i) bits |= static_cast<uint64_t>(host_cache_ptrs[i]);
  for (int bytes = 16; bytes > 1; bytes /= 2) {
    if ((bits & (bytes - 1)) == 0) return bytes;
  }
  return 1;
}

cudaError_t launch_move_rows(const int64_t* cache_ptrs, const int64_t* slots, const int64_t* layers,
                             void* buffer, int64_t num_moves, const RowLayout& layout, int vector_bytes,
                             bool gather, cudaStream_t stream) {
  if (num_moves == 0) return cudaSuccess;
  switch (vector_bytes) {
    case 16: return launch<16>(cache_ptrs, slots, layers, buffer, num_moves, layout, gather, stream);
    case 8: return launch<8>(cache_ptrs, slots, layers, buffer, num_moves, layout, gather, stream);
    case 4: return launch<4>(cache_ptrs, slots, layers, buffer, num_moves, layout, gather, stream);
    case 2: return launch<2>(cache_ptrs, slots, layers, buffer, num_moves, layout, gather, stream);
    case 1: return launch<1>(cache_ptrs, slots, layers, buffer, num_moves, layout, gather, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kvevict
