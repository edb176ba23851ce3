"""What the warm-up measured, site by site, until it becomes the ``Profile`` the search sees.

``ProfileRecorder`` takes the default, serialized and probe iterations' measurements from the
tuner (``tuner.py``), checks every sample against the config that was assigned to its site, and
keeps T_comp from the serialized iteration (per site, and per call where the backend timed calls). A site whose sample is missing from a probe
iteration, or that reports another config than the one assigned, is excluded (it keeps NCCL
defaults) with a warning naming the site, what was expected and what was found.

Samples measured in overlapped iterations carry ``t_comp_us`` as the backend saw it (often
unknown, NaN); ``build_profile`` replaces it with the serialized iteration's value for that site,
so every sample in the profile has the same T_comp for its region. The same holds per call: a
sample whose calls match the serialized iteration's in number gets each call's compute alone;
one that does not (a call missing or extra) loses its per-call times and counts as one region.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any

from lagom_megatron.engine.knobs import DEFAULT, CommConfig
from lagom_megatron.engine.profile import CollectiveSite, Profile, Sample
from lagom_megatron.engine.steps import IterationMeasurement

log = logging.getLogger("lagom.tuner")


class ProfileRecorder:
    """The measurements of one tuning run (module docstring).

    Args:
        backend: ``nccl``, ``gloo`` or ``sim``, recorded in the profile.
        cluster_name: the cluster's name, recorded in the profile.
        fingerprint: what is being tuned, copied into the profile.
    """

    def __init__(self, *, backend: str, cluster_name: str, fingerprint: dict[str, Any]) -> None:
        self.backend = backend
        self.cluster_name = cluster_name
        self.fingerprint = dict(fingerprint)
        self.sites: dict[str, CollectiveSite] = {}
        """Site id -> site, as the default iteration reported them."""
        self.default_us: list[float] = []
        """Iteration times under defaults, microseconds."""
        self.t_comp_us: dict[str, float] = {}
        """Site id -> its compute alone (the serialized iteration), microseconds."""
        self.t_comp_calls_us: dict[str, tuple[float, ...]] = {}
        """Site id -> each call's compute alone (the serialized iteration), microseconds, where the
        backend timed calls."""
        self.samples: list[Sample] = []
        """Every kept sample, as measured (T_comp filled in by ``build_profile``)."""
        self.excluded: dict[str, str] = {}
        """Site id -> why it was left out of the profile (it keeps NCCL defaults)."""

    def record_default(self, m: IterationMeasurement) -> bool:
        """Records the default iteration: its sites, iteration time and samples. Returns False when
        it reported no site (nothing overlapped to tune)."""
        if not m.sites:
            return False
        self.sites = {s.site_id: s for s in m.sites}
        self.default_us.append(m.iteration_us)
        self.samples.extend(self.keep(m, {}))
        return True

    def record_serialized(self, m: IterationMeasurement) -> None:
        """Records T_comp of every site from the serialized iteration (median of its calls)."""
        by_site: dict[str, list[float]] = {}
        self.t_comp_calls_us = {}
        for s in m.samples:
            if s.site_id in self.sites and math.isfinite(s.t_comp_us):
                by_site.setdefault(s.site_id, []).append(s.t_comp_us)
                if s.calls and all(math.isfinite(c[1]) for c in s.calls):
                    self.t_comp_calls_us[s.site_id] = tuple(c[1] for c in s.calls)
        missing = sorted(set(self.sites) - set(by_site))
        if missing:
            log.warning("serialized iteration %d: no T_comp for %d site(s), e.g. %s; they keep defaults",
                        m.iteration, len(missing), missing[:5])
        self.t_comp_us = {sid: statistics.median(v) for sid, v in by_site.items()}

    def record_probe(self, m: IterationMeasurement, assigned: dict[str, CommConfig], *, what: str) -> None:
        """Records a probe iteration run under ``assigned``; a site without a sample is excluded
        (``what`` names the iteration in the reason)."""
        kept = self.keep(m, assigned)
        seen = {s.site_id for s in kept}
        for sid in sorted(set(self.sites) - seen - set(self.excluded)):
            self.exclude(sid, f"{what}: expected a sample, found none")
        self.samples.extend(kept)

    def keep(self, m: IterationMeasurement, assigned: dict[str, CommConfig]) -> list[Sample]:
        """The samples of known sites, each checked against the config assigned to its site."""
        out = []
        for s in m.samples:
            if s.site_id not in self.sites:
                log.warning("iteration %d: sample for site %r not seen under defaults; ignored", m.iteration, s.site_id)
                continue
            expected = assigned.get(s.site_id, DEFAULT)
            if s.config != expected:
                self.exclude(s.site_id, f"iteration {m.iteration}: assigned {expected.to_dict() or 'defaults'}, "
                                        f"found config {s.config.to_dict()}")
                continue
            out.append(s)
        return out

    def _calls_with_compute(self, s: Sample) -> tuple:
        """``s.calls`` with each call's compute alone from the serialized iteration; () when the
        sample or the serialized iteration did not time calls, or their numbers differ."""
        comp = self.t_comp_calls_us.get(s.site_id)
        if not s.calls or comp is None or len(comp) != len(s.calls):
            return ()
        return tuple((c[0], t, c[2]) for c, t in zip(s.calls, comp))

    def exclude(self, site_id: str, why: str) -> None:
        """Leaves ``site_id`` out of the profile (it keeps NCCL defaults), saying why, once."""
        if site_id not in self.excluded:
            self.excluded[site_id] = why
            log.warning("lagom: site %r keeps NCCL defaults: %s", site_id, why)

    def build_profile(self) -> Profile:
        """The profile of everything recorded so far, T_comp filled in from the serialized iteration.

        Raises:
            RuntimeError: called before the default and serialized iterations were recorded.
        """
        if not self.default_us or not self.t_comp_us:
            raise RuntimeError(
                f"build_profile: needs the default and serialized iterations; have {len(self.default_us)} "
                f"default and {'a' if self.t_comp_us else 'no'} serialized measurement"
            )
        usable = {sid for sid in self.t_comp_us if sid not in self.excluded}
        samples = [
            Sample(site_id=s.site_id, config=s.config, t_comm_us=s.t_comm_us, t_comp_us=self.t_comp_us[s.site_id],
                   t_region_us=s.t_region_us, iteration=s.iteration, calls=self._calls_with_compute(s),
                   t_comm_nccl_us=s.t_comm_nccl_us)
            for s in self.samples
            if s.site_id in usable
        ]
        sites = [s for sid, s in self.sites.items() if sid in usable]
        return Profile(backend=self.backend, cluster=self.cluster_name, iteration_us=statistics.median(self.default_us),
                       sites=sites, samples=samples, fingerprint=dict(self.fingerprint))
