"""Our KVzip (``hf_reference/kvzip.py``) against kvpress 0.5.5's ``KVzipPress`` on the bundled model: the same
scores (float32, both sides) and the same kept entries, for a whole-context reconstruction and a chunked one,
with and without the KVzip+ normalisation. kvpress runs in ``.venv-ref``
(``tests/reference/kvzip_kvpress_scores.py``) on the same token ids.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from kvpress_runner import REF_PYTHON, require_reference_env
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_kvevict.hf_reference.kvzip import chat_template_parts, encode, global_kept, kvzip_scores

pytestmark = [pytest.mark.reference, pytest.mark.model]

SCRIPT = Path(__file__).resolve().parent / "kvzip_kvpress_scores.py"
CONTEXT = (
    "The harbour board met on a rainy Tuesday. The treasurer said the new crane had cost 4,812 crowns, "
    "twice the estimate, that ferry tolls fell by a fifth after the bridge opened, and that the pilots "
    "asked for a second boat. Mrs. Okafor proposed selling the old dredger to the river authority; "
    "the motion passed seven votes to two. The next meeting will discuss the lighthouse roof. "
) * 2
#: (key, compression ratio, reconstruction chunk, KVzip+): one pass over the whole context, and chunks of
#: 48 tokens (several "starting with" prompts) with and without the normalisation
JOBS = (
    ("whole@0.5", 0.5, 2048, False),
    ("chunked@0.75", 0.75, 48, False),
    ("chunked-plus@0.5", 0.5, 48, True),
)


@pytest.fixture(scope="module")
def prompt(model_dir: Path) -> tuple[torch.Tensor, int]:
    """(ids [n]: the chat template's user prefix then the context, the prefix length) as kvpress sees it."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prefix = encode(tokenizer, chat_template_parts(tokenizer)[0])
    return torch.cat([prefix, encode(tokenizer, CONTEXT)]), int(prefix.shape[0])


@pytest.fixture(scope="module")
def kvpress_results(model_dir: Path, prompt, tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    require_reference_env()
    work = tmp_path_factory.mktemp("kvzip")
    jobs = [{"key": k, "compression_ratio": r, "chunk_size": c, "plus": p} for k, r, c, p in JOBS]
    torch.save({"model_dir": str(model_dir), "input_ids": prompt[0], "jobs": jobs}, work / "case.pt")
    done = subprocess.run(
        [str(REF_PYTHON), str(SCRIPT), str(work / "case.pt"), str(work / "out.pt")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        pytest.fail(f"kvpress KVzip script failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return torch.load(work / "out.pt", weights_only=True)


@pytest.fixture(scope="module")
def ours(model_dir: Path, prompt) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
    )
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids, start = prompt
    return {
        key: kvzip_scores(
            model.eval(), tokenizer, ids, context_start=start, chunk_size=chunk, plus=plus
        ).scores
        for key, _, chunk, plus in JOBS
    }


@pytest.mark.parametrize("job", JOBS, ids=[job[0] for job in JOBS])
def test_scores_equal_kvpress(job, ours, kvpress_results, prompt) -> None:
    key = job[0]
    theirs = kvpress_results[key]["scores"]
    assert bool((ours[key][..., prompt[1] :] > 0).all()), "every context key gets a score"
    torch.testing.assert_close(ours[key], theirs, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("job", JOBS, ids=[job[0] for job in JOBS])
def test_kept_entries_equal_kvpress(job, ours, kvpress_results) -> None:
    key, ratio = job[0], job[1]
    kept = global_kept(ours[key], ratio)
    theirs = kvpress_results[key]["kept"]
    assert int(kept.sum()) == int(theirs.sum())
    differ = kept != theirs
    # Only entries whose scores sit at the cut (equal within float noise) may land on either side.
    cut = ours[key][~kept].max()
    assert bool(((ours[key][differ] - cut).abs() <= 1e-6 * cut.abs().clamp_min(1e-6) + 1e-7).all()), (
        f"{int(differ.sum())} kept entries differ from kvpress's away from the cut"
    )
