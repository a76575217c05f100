"""Whether a publish may adopt the READY artifact that already holds its binding (model version, format, GPU).

A binding holds one artifact, so a second publish of it builds nothing and hands back the first one's. That
is right for a repeated request (a retried CI job), wrong for one asking for what that artifact is not: a
tighter accuracy budget than the artifact meets (a CI gate would pass an artifact over its limit), a QoQ step
switched otherwise (an ablation would measure the other recipe), or pinned calibration / eval data other than
the artifact's. Those jobs fail, naming the difference, instead of succeeding with the other artifact."""

from __future__ import annotations

from services.quantizer.config import over_budget
from services.quantizer.errors import AccuracyBudgetExceeded, BindingMismatch
from services.quantizer.publish_spec import PublishSpec
from shared.formats.manifest import Manifest


def check_adoptable(spec: PublishSpec, artifact_id: str, manifest: Manifest) -> None:
    """Raises AccuracyBudgetExceeded or BindingMismatch when the artifact does not answer this request."""
    e = manifest.evaluation
    if e is not None and over_budget(e.ppl_fp16, e.ppl_quantized, spec.budget):
        raise AccuracyBudgetExceeded(
            f"accuracy budget exceeded: artifact {artifact_id}, already published for this binding, has quantized "
            f"perplexity {e.ppl_quantized:.4f} vs fp16 {e.ppl_fp16:.4f} on {e.data_name} ({e.ratio - 1:+.2%}), "
            f"above this request's budget of {spec.budget:.2%} (max_relative_perplexity_increase={spec.budget:g})"
        )
    differences = [f"{step} {'on' if wanted else 'off'} (the artifact has it {'on' if not wanted else 'off'})"
                   for step, wanted in sorted(spec.qoq.items()) if manifest.options.get(step, wanted) != wanted]
    calibration = manifest.calibration or {}
    if spec.calib_sha256 and calibration.get("data_sha256") not in (None, spec.calib_sha256):
        differences.append(f"calibration data sha256 {spec.calib_sha256[:12]}... (the artifact's: "
                           f"{calibration['data_sha256'][:12]}...)")
    if spec.eval_sha256 and e is not None and e.data_sha256 != spec.eval_sha256:
        differences.append(f"eval data sha256 {spec.eval_sha256[:12]}... (the artifact's: {e.data_sha256[:12]}...)")
    if differences:
        raise BindingMismatch(
            f"artifact {artifact_id} already publishes model version {manifest.model_version[:12]} as "
            f"{manifest.format} for {manifest.gpu_target}, made otherwise than this request asks: "
            f"{'; '.join(differences)}. A binding holds one artifact: to build these settings, publish under "
            f"another model name"
        )
