"""``ProfileRecorder``: the warm-up's measurements until they become the search's ``Profile``. A sample under another
config than assigned, or a probe missing a site, excludes the site (it keeps NCCL defaults)."""

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
    """The measurements of one tuning run; ``backend``, ``cluster_name``, ``fingerprint`` go to the profile."""

    def __init__(self, *, backend: str, cluster_name: str, fingerprint: dict[str, Any]) -> None:
        self.backend = backend
        self.cluster_name = cluster_name
        self.fingerprint = dict(fingerprint)
        self.sites: dict[str, CollectiveSite] = {}
        self.default_us: list[float] = []
        self.t_comp_us: dict[str, float] = {}
        """Site id -> compute alone (the serialized iteration)."""
        self.t_comp_calls_us: dict[str, tuple[float, ...]] = {}
        """The same per call, where calls were timed."""
        self.samples: list[Sample] = []
        self.excluded: dict[str, str] = {}
        """Site id -> why it was left out of the profile (it keeps NCCL defaults)."""

    def record_default(self, m: IterationMeasurement) -> bool:
        """Records the default iteration's sites, time and samples; False when it reported no site."""
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
            log.warning(
                "serialized iteration %d: no T_comp for %d site(s), e.g. %s; they keep defaults",
                m.iteration,
                len(missing),
                missing[:5],
            )
        self.t_comp_us = {sid: statistics.median(v) for sid, v in by_site.items()}

    def record_probe(self, m: IterationMeasurement, assigned: dict[str, CommConfig], *, what: str) -> None:
        """Records a probe iteration run under ``assigned``; a site without a sample is excluded."""
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
                self.exclude(
                    s.site_id,
                    f"iteration {m.iteration}: assigned {expected.to_dict() or 'defaults'}, "
                    f"found config {s.config.to_dict()}",
                )
                continue
            out.append(s)
        return out

    def _calls_with_compute(self, s: Sample) -> tuple:
        """``s.calls`` with each call's serialized compute; () unless both timed the same number of calls."""
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
        """The profile recorded so far, T_comp from the serialized iteration; RuntimeError before it and the default."""
        if not self.default_us or not self.t_comp_us:
            raise RuntimeError(
                f"build_profile: needs the default and serialized iterations; have {len(self.default_us)} "
                f"default and {'a' if self.t_comp_us else 'no'} serialized measurement"
            )
        usable = {sid for sid in self.t_comp_us if sid not in self.excluded}
        samples = [
            Sample(
                site_id=s.site_id,
                config=s.config,
                t_comm_us=s.t_comm_us,
                t_comp_us=self.t_comp_us[s.site_id],
                t_region_us=s.t_region_us,
                iteration=s.iteration,
                calls=self._calls_with_compute(s),
            )
            for s in self.samples
            if s.site_id in usable
        ]
        sites = [s for sid, s in self.sites.items() if sid in usable]
        return Profile(
            backend=self.backend,
            cluster=self.cluster_name,
            iteration_us=statistics.median(self.default_us),
            sites=sites,
            samples=samples,
            fingerprint=dict(self.fingerprint),
        )
