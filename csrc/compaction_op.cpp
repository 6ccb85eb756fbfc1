// torch op kvevict::compact_slots: the CUDA compaction kernels behind the torch dispatcher.
//
// Built JIT by vllm_kvevict/layout/kernels/cuda_ext.py (torch.utils.cpp_extension.load) where CUDA exists.
// Semantics and argument checks mirror vllm_kvevict.layout.kernels.reference.compact_subblocks.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "compaction_kernels.cuh"

namespace kvevict {
namespace {

void check_index(const at::Tensor& t, const char* name, const at::Device& device, int64_t numel) {
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), ", the caches on ", device);
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(), name,
              " must be a contiguous 1-D int64 tensor, got ", t.scalar_type(), " of shape ", t.sizes());
  TORCH_CHECK(t.numel() == numel, name, " has ", t.numel(), " entries, expected ", numel);
}

// caches: L layer caches, each [S, bs, D] or [P, S, bs, D] with contiguous D, identical shape and strides.
// src_slots, dst_slots, layer_idx: [M] int64 (validated for range and uniqueness by the Python caller).
void compact_slots(const std::vector<at::Tensor>& caches, const at::Tensor& src_slots,
                   const at::Tensor& dst_slots, const at::Tensor& layer_idx) {
  TORCH_CHECK(!caches.empty(), "compact_slots needs at least one layer cache");
  const at::Tensor& first = caches[0];
  TORCH_CHECK(first.is_cuda(), "compact_slots runs on CUDA tensors, got a cache on ", first.device());
  TORCH_CHECK(first.dim() == 3 || first.dim() == 4,
              "a layer cache must be [S, block_size, D] or [P, S, block_size, D], got ", first.sizes());
  TORCH_CHECK(first.stride(-1) == 1, "the head_size dim of a layer cache must be contiguous");
  for (size_t i = 1; i < caches.size(); ++i) {
    TORCH_CHECK(caches[i].sizes() == first.sizes() && caches[i].strides() == first.strides() &&
                    caches[i].scalar_type() == first.scalar_type() && caches[i].device() == first.device(),
                "layer cache ", i, " differs from layer cache 0 in shape, strides, dtype or device");
  }
  const int64_t num_moves = src_slots.numel();
  check_index(src_slots, "src_slots", first.device(), num_moves);
  check_index(dst_slots, "dst_slots", first.device(), num_moves);
  check_index(layer_idx, "layer_idx", first.device(), num_moves);
  if (num_moves == 0) return;

  const c10::cuda::CUDAGuard device_guard(first.device());
  const int64_t elem = first.element_size();
  const bool planar = first.dim() == 4;
  RowLayout layout;
  layout.num_planes = planar ? first.size(0) : 1;
  layout.plane_stride = planar ? first.stride(0) * elem : 0;
  layout.subblock_stride = first.stride(-3) * elem;
  layout.token_stride = first.stride(-2) * elem;
  layout.block_size = first.size(-2);
  layout.row_bytes = first.size(-1) * elem;

  std::vector<int64_t> host_ptrs;
  host_ptrs.reserve(caches.size());
  for (const auto& cache : caches) host_ptrs.push_back(reinterpret_cast<int64_t>(cache.data_ptr()));
  const at::Tensor cache_ptrs =
      at::tensor(host_ptrs, at::TensorOptions().dtype(at::kLong)).to(first.device(), /*non_blocking=*/true);
  at::Tensor buffer = at::empty({num_moves, layout.num_planes, first.size(-1)}, first.options());
  const int vector_bytes = pick_vector_bytes(layout, host_ptrs.data(), static_cast<int64_t>(host_ptrs.size()),
                                             reinterpret_cast<uint64_t>(buffer.data_ptr()));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* ptrs = cache_ptrs.data_ptr<int64_t>();
  const int64_t* layers = layer_idx.data_ptr<int64_t>();
  C10_CUDA_CHECK(launch_move_rows(ptrs, src_slots.data_ptr<int64_t>(), layers, buffer.data_ptr(), num_moves,
                                  layout, vector_bytes, /*gather=*/true, stream));
  C10_CUDA_CHECK(launch_move_rows(ptrs, dst_slots.data_ptr<int64_t>(), layers, buffer.data_ptr(), num_moves,
                                  layout, vector_bytes, /*gather=*/false, stream));
}

}  // namespace
}  // namespace kvevict

TORCH_LIBRARY(kvevict, m) {
  m.def("compact_slots(Tensor(a!)[] caches, Tensor src_slots, Tensor dst_slots, Tensor layer_idx) -> ()");
}

TORCH_LIBRARY_IMPL(kvevict, CUDA, m) { m.impl("compact_slots", &kvevict::compact_slots); }
