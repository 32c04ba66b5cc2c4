"""`attnviz split`: one layer's head split and its proof, from random init, a checkpoint or a
Hugging Face model (optionally verified against the model's own attention)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.core.request import HeadHints, RandomSpec
from attnviz.errors import CheckFailed, UsageError, option

if TYPE_CHECKING:
    from attnviz.compute.forward_pass.forward import LayerWeights
    from attnviz.compute.splitting.split import SplitReport
    from attnviz.compute.splitting.split_views import BandPicture, MatrixPanel
    from attnviz.core.layer import AttentionLayer
    from attnviz.sources.hf.split_proof_result import ProofResult
    from attnviz.sources.hf.verify import VerifyResult

VERIFY_SENTENCES = ["the cat sat on the mat and the cat slept",
                    "heads split the projection, not the input"]
# an encoder-decoder model's decoder input for the proofs, one per sentence
VERIFY_TARGETS = ["the cat slept on the mat", "the input is split by no head"]


@dataclass(frozen=True)
class SplitRequest:
    """Exactly one source: `random` (the default when nothing else is given), `weights` (a
    checkpoint and `layer` in it) or `model` (a Hugging Face folder or cached hub id)."""

    weights: Path | None = None
    model: str | None = None
    layer: str | None = None
    hints: HeadHints = HeadHints()
    random: RandomSpec | None = None
    seed: int = 0  # of the proof's random batch
    verify: bool = False  # --model: recompute the layer and compare with the model itself


@dataclass
class SplitResult:
    layer: AttentionLayer
    source: str
    report: SplitReport
    layer_weights: LayerWeights
    verified: VerifyResult | None = None  # the recompute proof, where it applies
    sentences: tuple[str, ...] = tuple(VERIFY_SENTENCES)
    proof: ProofResult | None = None  # the split proof (split --model --verify)
    recompute_skipped: str | None = None  # why the recompute proof did not run

    @property
    def failure(self) -> CheckFailed | None:
        """The check that did not hold, if any: the CLI exits 1 with it."""
        if self.verified is not None and not math.isfinite(self.verified.max_diff):
            return _non_finite_model(self.source)
        if self.proof is not None and not self.proof.passed:
            worst = self.proof.failures[0]
            return CheckFailed(f"the split proof failed for {len(self.proof.failures)} "
                               f"of {len(self.proof.checks)} perturbations (first: W_"
                               f"{worst.projection} head {worst.head}: {worst.reason})",
                               fix="attnviz's head slicing of this layer is wrong: report this "
                               "with the model")
        if self.verified is not None and not self.verified.passed:
            return CheckFailed(f"attnviz's per-head recomputation differs from the model's own "
                               f"attention by {self.verified.max_diff:.2e}, above "
                               f"{self.verified.tolerance:.0e}", fix="report this with the model")
        proof = self.report.proof
        if proof is not None and not proof.passed:
            return CheckFailed(f"the per-head recomputation differs from the reference by "
                               f"{proof.max_abs_diff:.2e}, above the tolerance",
                               fix="report this with the checkpoint")
        return None

    @property
    def passed(self) -> bool:
        return self.failure is None

    def band_picture(self, max_cols: int) -> BandPicture:
        from attnviz.compute.splitting.split_views import band_picture

        return band_picture(self.layer, self.layer_weights.W_q, max_cols=max_cols)

    def explanation(self) -> list[str]:
        from attnviz.compute.splitting.split_views import explanation

        return explanation(self.layer)

    def matrix_panels(self) -> list[MatrixPanel]:
        from attnviz.compute.splitting.split_views import matrix_panels

        return matrix_panels(self.layer, self.layer_weights)

    @property
    def title(self) -> str:
        return (f"{self.layer.name or self.source}: {self.layer.num_heads} heads × d = "
                f"{self.layer.head_dim}")

    def to_json(self) -> dict[str, Any]:
        doc = self.report.to_json()
        doc["source"] = self.source
        if self.proof is not None:
            doc["verify"] = {"passed": self.failure is None, "label": self.proof.label,
                             "layer": self.proof.layer_index,
                             "sentences": list(self.sentences),
                             "proofs": ["split"] + (["recompute"] if self.verified else []),
                             "split": self.proof.to_json()}
            if self.verified is not None:
                v = self.verified
                doc["verify"]["recompute"] = {
                    "layer": v.layer_index, "max_abs_diff": v.max_diff, "per_head": v.per_head,
                    "tolerance": v.tolerance, "positions": v.positions, "passed": v.passed}
            else:
                doc["verify"]["recompute"] = {"skipped": self.recompute_skipped}
        return doc


def _non_finite_model(source: str) -> CheckFailed:
    """The model's own maps on the verification sentences hold NaN or Inf: its weights or the
    config.json fields its forward computes with are the cause, not attnviz's slicing."""
    from attnviz.sources.hf.config_guard import config_hint

    hint = config_hint(source)
    return CheckFailed("the model's own attention on the verification sentences is not finite "
                       "(NaN or Inf)",
                       fix=f"check the weights with 'attnviz inspect {option('scan')}'"
                       + (f"; or check the {hint}" if hint else ""), where=source)


def run_split(request: SplitRequest) -> SplitResult:
    """The split, its proof and (with verify) the model's own check, for one layer."""
    from attnviz.compute.splitting.split import make_report

    if request.verify and request.model is None:
        raise UsageError(f"{option('verify')} needs {option('model')}",
                         fix="pass a Hugging Face model folder")
    from attnviz.core.request import SourceSpec
    from attnviz.sources.registry import SourceKind, open_source, source_kind

    spec = SourceSpec(weights=request.weights, model=request.model, random=request.random,
                      hints=request.hints)
    kind = source_kind(spec)  # more than one source is refused here, once
    if kind is SourceKind.BUNDLED:  # split's default: a random layer, seeded as the proof
        if request.layer is not None or request.hints.num_kv_heads is not None \
                or request.hints.head_dim is not None:
            raise UsageError(f"{option('layer')}, {option('num_kv_heads')} and "
                             f"{option('head_dim')} need {option('weights')} or {option('model')}")
        spec = SourceSpec(random=RandomSpec(seed=request.seed), hints=request.hints)
    elif kind is SourceKind.RANDOM and (request.layer is not None
                                        or request.hints.num_kv_heads is not None
                                        or request.hints.head_dim is not None):
        raise UsageError(f"{option('layer')}, {option('num_kv_heads')} and "
                         f"{option('head_dim')} need {option('weights')} or {option('model')}")
    opened = open_source(spec)
    verified = proof = skipped = None
    if kind is SourceKind.MODEL:
        layer = opened.select(request.layer if request.layer is not None else "0")
        if request.verify:
            assert opened.folder is not None
            verified, proof, skipped = verify_model_layer(str(opened.folder), layer)
    elif kind is SourceKind.WEIGHTS:
        layer = opened.select(request.layer)
    else:
        layer = opened.layers[0]
    store = opened.store
    report, layer_weights = make_report(layer, store, request.seed)
    return SplitResult(layer, store.source, report, layer_weights, verified,
                       proof=proof, recompute_skipped=skipped)


def verify_model_layer(folder: str, layer: AttentionLayer) -> tuple[Any, Any, str | None]:
    """(recompute proof or None, split proof, why the recompute proof did not run)."""
    from attnviz.sources.hf.layers import ModelRun, RunInputs, plan_run
    from attnviz.sources.hf.load import load_model
    from attnviz.sources.hf.split_proof import prove_split
    from attnviz.sources.hf.verify import call_of, recompute_supported, verify_layer

    loaded = load_model(folder)
    targets = VERIFY_TARGETS if loaded.encoder_decoder else None
    proof = prove_split(loaded, layer, VERIFY_SENTENCES, targets)
    plan = plan_run(loaded, RunInputs(VERIFY_SENTENCES, targets), None,
                    ModelRun(need_layers=True))
    call = call_of(plan.layers, loaded.model, layer)
    skipped = recompute_supported(loaded, call)
    verified = None
    if skipped is None:
        verified = verify_layer(loaded, layer, VERIFY_SENTENCES, plan=plan)
    return verified, proof, skipped
