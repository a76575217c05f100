"""Which arm of a deployment serves a request: the baseline while fallback is on, otherwise the
canary for canary_percent of traffic and the stable for the rest.

Sticky split: a session key is hashed (with the deployment name, so that one key does not land on
the canary of every deployment) to one of 10,000 buckets; buckets below percent * 100 go to the
canary. Raising the percentage only adds buckets, so a key on the canary stays there."""

from __future__ import annotations

import enum
import hashlib
import random
from dataclasses import dataclass

from services.gateway.deployments import ArtifactRefView, DeploymentView
from shared.rpc.qserve.v1 import gateway_pb2

BUCKETS = 10_000


class Arm(enum.Enum):
    STABLE = gateway_pb2.ARM_STABLE
    CANARY = gateway_pb2.ARM_CANARY
    BASELINE = gateway_pb2.ARM_BASELINE

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Route:
    arm: Arm
    artifact: ArtifactRefView


def bucket_of(deployment: str, session_key: str) -> int:
    digest = hashlib.blake2b(f"{deployment}\x00{session_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def choose(deployment: DeploymentView, session_key: str, rng: random.Random | None = None) -> Route:
    if deployment.fallback and deployment.baseline is not None:
        return Route(Arm.BASELINE, deployment.baseline)
    if deployment.canary is not None and deployment.canary_percent > 0:
        bucket = bucket_of(deployment.name, session_key) if session_key else (rng or random).randrange(BUCKETS)
        if bucket < deployment.canary_percent * (BUCKETS // 100):
            return Route(Arm.CANARY, deployment.canary)
    return Route(Arm.STABLE, deployment.stable)


def fallback_routes(deployment: DeploymentView, chosen: Route) -> list[Route]:
    """Where a request goes, in order, when its arm has no healthy worker: a canary's to the vetted
    stable (what the session would get without the rollout), then the fp16 baseline if there is one."""
    routes = [Route(Arm.STABLE, deployment.stable)] if chosen.arm is Arm.CANARY else []
    if deployment.baseline is not None and chosen.arm is not Arm.BASELINE:
        routes.append(Route(Arm.BASELINE, deployment.baseline))
    return routes
