// Compaction of kept KV rows: device side, free of torch headers so nvcc can compile it anywhere.
//
// A "move" copies one token row (head_size elements, in every plane) of one layer cache from a slot to a
// staging buffer (gather) or from the buffer to a slot (scatter). Both phases cover all requests and layers
// of a step in one launch each; two launches because sources and destinations overlap and a grid has no
// global barrier. Layer caches are reached through a device table of base addresses.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvevict {

// Geometry shared by every layer cache of one call, in bytes (slot = subblock * block_size + offset).
struct RowLayout {
  int64_t num_planes;       // planes moved together (e.g. 2 for K and V)
  int64_t plane_stride;     // bytes between planes
  int64_t subblock_stride;  // bytes between sub-blocks
  int64_t token_stride;     // bytes between token rows of a sub-block
  int64_t block_size;       // tokens per sub-block
  int64_t row_bytes;        // head_size * element size
};

// Largest copy width in bytes (16, 8, 4, 2 or 1) dividing every address a move touches.
int pick_vector_bytes(const RowLayout& layout, const int64_t* host_cache_ptrs, int64_t num_caches,
                      uint64_t buffer_ptr);

// gather = true: buffer[m, p, :] = cache[layers[m]] row at slots[m], plane p; false: the reverse.
cudaError_t launch_move_rows(const int64_t* cache_ptrs, const int64_t* slots, const int64_t* layers,
                             void* buffer, int64_t num_moves, const RowLayout& layout, int vector_bytes,
                             bool gather, cudaStream_t stream);

}  // namespace kvevict
