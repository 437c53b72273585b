"""Preemption notice from a cloud metadata endpoint, polled on a background thread.

AWS: ``http://169.254.169.254/latest/meta-data/spot/instance-action`` answers 404 until a
notice, then ``{"action": "terminate", "time": "<UTC ISO>"}`` (two minutes ahead; AWS asks to
poll every 5 s; IMDSv2 needs a token). GCP: ``http://metadata.google.internal/computeMetadata/
v1/instance/preempted`` with header ``Metadata-Flavor: Google`` answers ``TRUE`` once the
30-second notice is out. The training thread only reads what the poller last saw, so a slow
or unreachable endpoint never stalls training.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from datetime import datetime
from typing import Literal

from pcframe.policies.base import Notice
from pcframe.policies.notices.base import NoticeSource
from pcframe.policies.registry import register

Flavor = Literal["aws", "gcp", "generic"]
AWS_URL = "http://169.254.169.254/latest/meta-data/spot/instance-action"
AWS_TOKEN_URL = "http://169.254.169.254/latest/api/token"
GCP_URL = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"


def parse_response(status: int, body: str, flavor: Flavor) -> tuple[bool, float | None]:
    """(notice pending?, termination wall time if the endpoint says it)."""
    if status != 200:
        return False, None
    text = body.strip()
    if flavor == "gcp":
        return text.upper() == "TRUE", None
    if not text or text.lower() in ("false", "0", "none", "null"):
        return False, None
    try:
        doc = json.loads(text)
    except ValueError:
        return flavor == "generic", None
    if isinstance(doc, dict) and "time" in doc:
        try:
            return True, datetime.fromisoformat(str(doc["time"]).replace("Z", "+00:00")).timestamp()
        except ValueError:
            return True, None
    return bool(doc), None


@register()
class MetadataNoticeSource(NoticeSource):
    """Polls ``url`` every ``poll_interval`` seconds on a daemon thread.

    Args:
        url: endpoint; defaults to the AWS or GCP one for ``flavor``.
        flavor: ``aws`` (JSON with a termination ``time``; 404 = none), ``gcp`` (``TRUE``),
            ``generic`` (any 200 with a body that is not false/0/empty).
        window: seconds left when the endpoint does not give a time (AWS 120, GCP 30).
        headers: extra request headers (GCP's ``Metadata-Flavor: Google`` is added for gcp).
        token_url: IMDSv2 token endpoint (``aws`` only; ``None`` for IMDSv1).
        timeout: seconds per HTTP request.
    """

    name = "metadata_url"

    def __init__(
        self,
        url: str | None = None,
        flavor: Flavor = "aws",
        window: float | None = None,
        poll_interval: float = 5.0,
        headers: Mapping[str, str] | None = None,
        token_url: str | None = None,
        timeout: float = 1.0,
    ) -> None:
        if flavor not in ("aws", "gcp", "generic"):
            raise ValueError(f"flavor={flavor!r} must be 'aws', 'gcp' or 'generic'")
        seconds = {"window": 1.0 if window is None else window}
        seconds |= {"poll_interval": poll_interval, "timeout": timeout}
        for key, value in seconds.items():
            # ``not > 0``: NaN too (a NaN poll_interval made the poller's wait return at
            # once, a loop hammering the endpoint; a NaN window, a deadline never met)
            if not value > 0:
                raise ValueError(f"{key}={value} must be > 0 seconds")
        self.flavor: Flavor = flavor
        self.url = url or (GCP_URL if flavor == "gcp" else AWS_URL)
        self.window = float(window if window is not None else (30.0 if flavor == "gcp" else 120.0))
        self.poll_interval = float(poll_interval)
        self.headers = dict(headers or {})
        if flavor == "gcp":
            self.headers.setdefault("Metadata-Flavor", "Google")
        self.token_url = token_url
        self.timeout = float(timeout)
        self.last_error: str | None = None
        self.polls = 0
        self._seen: tuple[float, float] | None = None  # (wall time seen, wall time of deadline)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _request(self) -> tuple[int, str]:
        headers = dict(self.headers)
        if self.token_url and self.flavor == "aws":
            req = urllib.request.Request(
                self.token_url,
                method="PUT",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": "21600"},
            )
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                headers["X-aws-ec2-metadata-token"] = r.read().decode()
        req = urllib.request.Request(self.url, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, ""

    def check_once(self) -> None:
        """One poll of the endpoint (what the thread does every ``poll_interval``)."""
        try:
            status, body = self._request()
        # Unreachable, timeout, bad URL, and an answer that is not HTTP or is cut short
        # (http.client's errors are not OSErrors: they ended the poller thread, and every
        # later notice was missed): no notice this time, the next poll tries again.
        except (OSError, ValueError, http.client.HTTPException) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            return
        finally:
            self.polls += 1
        pending, deadline = parse_response(status, body, self.flavor)
        with self._lock:
            if pending and self._seen is None:
                seen = time.time()
                self._seen = (seen, deadline if deadline is not None else seen + self.window)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check_once()
            self._stop.wait(self.poll_interval)

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="pcframe-notice", daemon=True)
        self._thread.start()

    def poll(self, now: float) -> Notice | None:
        with self._lock:
            seen = self._seen
        if seen is None:
            return None
        wall = time.time()
        return Notice(
            received_at=now - (wall - seen[0]),
            deadline=now + (seen[1] - wall),
            source=f"metadata:{self.flavor}",
        )

    def reset(self) -> None:
        with self._lock:
            self._seen = None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 1.0)
            self._thread = None
