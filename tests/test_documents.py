"""Document masking (data.document_mask): a document packed after another reads as if alone, training with it
keeps parity in layouts of every cp mode, and it changes what a run learns from packed documents."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from sixfold.config import load_config
from sixfold.data import BatchLoader, _windows
from sixfold.model.documents import document_ids
from sixfold.model.llama import Llama, init_weights
from sixfold.parallel.context import ring_masks
from sixfold.train import train
from helpers import TINY, sixfold


def test_the_end_of_text_closes_its_document():
    tokens = torch.tensor([[5, 0, 7, 7, 0, 0, 9], [1, 2, 3, 4, 5, 6, 7]])
    assert document_ids(tokens, 0).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0] * 7]


def test_a_prompts_end_of_text_closes_no_document():
    """A chat template's marker that is the end of text (Llama 2's `</s>`) inside a prompt (held as id + shift):
    the answer after it stays in the prompt's document; the end of text after the answer closes it."""
    stream = np.array([1, 10 + 0, 10 + 2, 3, 0, 10 + 1, 4, 0, 5], dtype=np.uint16)  # shift 10, end of text 0
    x, y, ids = _windows(stream, [0], 8, 10, 0)
    assert x.tolist() == [[1, 0, 2, 3, 0, 1, 4, 0]] and ids.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]]
    assert BatchLoader(stream, 8, 1, 0, shift=10).batch(0)[2] is None  # without data.document_mask


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_a_document_packed_after_another_reads_as_if_alone(recompute):
    """Logits of a document inside a window, after the end of another, equal those of the document alone at the
    window's start (rotary scores depend on distances only), to fp32 round-off; without the mask they do not."""
    cfg = load_config(TINY, [f"model.recompute={recompute}"]).model
    model = Llama(cfg)
    init_weights(model, 0)
    g = torch.Generator().manual_seed(0)
    first, second = torch.randint(1, 256, (2, 11), generator=g), torch.randint(1, 256, (2, 21), generator=g)
    first[:, -1] = 256  # the byte tokenizer's end of text
    window = torch.cat([first, second], 1)
    ids = document_ids(window, 256)
    t = model.tokens(*window.shape, window.device, documents=ids)
    packed = model.full_logits(model.logits(model.run(model.stages[0], window, t), False)).view(2, 32, -1)
    alone = model(second)
    assert torch.allclose(packed[:, 11:], alone, atol=2e-5, rtol=0), float((packed[:, 11:] - alone).abs().max())
    assert torch.allclose(packed[:, :11], model(first), atol=2e-5, rtol=0)
    assert not torch.allclose(model(window)[:, 11:], alone, atol=1e-2, rtol=0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Short documents (about 40 bytes): every window of 32 tokens crosses one."""
    path = tmp_path_factory.mktemp("documents") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i % 7}\n"}) + "\n"
                            for i in range(400)))
    return path


@pytest.mark.parametrize("layout", [
    ["parallel.pp=2", "parallel.tp=2", "parallel.cp=2", "train.micro_batches=2"],
    ["parallel.cp=2", "parallel.cp_mode=ulysses", "parallel.tp=2", "parallel.dp_shard=2", "parallel.zero=3",
     "train.seq_len=256", "data.val_fraction=0.2"],  # attention in chunks, each making its mask from the ids
    ["parallel.cp=2", "parallel.cp_mode=allgather", "parallel.cp_zigzag=false", "parallel.dp_replicate=2"],
], ids=["pp2-cp2-ring-tp2", "cp2-ulysses-tp2-zero3", "cp2-allgather-contiguous-dp2"])
def test_training_within_documents_keeps_parity(corpus, tmp_path, layout):
    proc = sixfold("check", TINY, f"data.source={corpus}", "data.document_mask=true",
                   f"data.cache_dir={tmp_path / 'cache'}", "train.eval_every=3", *layout, "--steps", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("parity OK"), proc.stdout


def test_the_mask_changes_what_a_run_computes(corpus, tmp_path):
    losses = {}
    for masked in (False, True):
        cfg = load_config(TINY, [f"log.run_dir={tmp_path / str(masked)}", f"data.source={corpus}",
                                 f"data.cache_dir={tmp_path / 'cache'}", f"data.document_mask={masked}",
                                 "train.steps=2", "train.eval_every=2", "train.eval_batches=1"])
        losses[masked] = [(m["loss"], m.get("val_loss")) for m in train(cfg)]
    assert losses[True][0][0] != losses[False][0][0] and losses[True][-1][1] != losses[False][-1][1], losses


def _compiled_and_eager():
    """The test model with compiled blocks, the same model eager, and an input to a block."""
    model, eager = Llama(load_config(TINY).model), Llama(load_config(TINY).model)
    init_weights(model, 0)
    init_weights(eager, 0)
    torch._dynamo.reset()  # what other tests compiled of the same block code
    model.compile_blocks(backend="eager")
    return model, eager, torch.randn(64, model.cfg.dim)


def test_a_compiled_block_keeps_the_rings_masks_out_of_its_guards():
    """train.compile keeps context-parallel attention eager: a block compiled once runs every pattern of documents
    (which ring chunk pairs are skipped, masked or left to causality) without compiling again, as eager does."""
    model, eager, x = _compiled_and_eager()
    patterns, base = set(), model.tokens(2, 32, x.device)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for ends in ([], [5], [15, 16], [20], [3, 30], [16, 17, 18]):
            tokens = torch.ones(2, 32, dtype=torch.long)
            tokens[0, ends] = 0
            masks = ring_masks(model.cp, document_ids(tokens, 0), torch.float32)
            patterns.add(tuple((pair, m is None) for pair, (m, _) in sorted(masks.items())))
            t = replace(base, context=True, mask=masks)
            assert torch.allclose(model.layers["0"](x, t), eager.layers["0"](x, t), atol=1e-6, rtol=0)
    assert len(patterns) >= 4


def test_a_compiled_block_takes_the_whole_mask_made_outside_it():
    """On one rank attention runs inside the compiled block: the model makes the whole mask before it (eager makes
    masks as attention asks), and every pattern of documents runs without compiling again."""
    model, eager, x = _compiled_and_eager()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for ends in ([], [5], [15, 16], [3, 30]):
            tokens = torch.ones(2, 32, dtype=torch.long)
            tokens[0, ends] = 0
            t, t_eager = (m.tokens(2, 32, x.device, documents=document_ids(tokens, 0)) for m in (model, eager))
            assert t.mask._dense is not None and t_eager.mask._dense is None
            assert torch.allclose(model.layers["0"](x, t), eager.layers["0"](x, t_eager), atol=1e-6, rtol=0)
