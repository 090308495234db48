"""Where a server may listen: loopback by default, a warning beyond it.

Both of the policy's servers (JetStream's gRPC one, `jetstream_bridge`, and
the OpenAI-compatible HTTP one, `openai_api`) have no TLS, and the HTTP one
no authentication unless given a key, so they bind 127.0.0.1 unless told
otherwise and log `exposure_warning` when told.
"""

from __future__ import annotations

import ipaddress

LOOPBACK_HOST = "127.0.0.1"


def is_loopback(host: str) -> bool:
  """True for 127.0.0.0/8 (also IPv4-mapped), ::1 and `localhost`; `[::1]` too."""
  host = host.strip().strip("[]")
  if host.lower() == "localhost":
    return True
  try:
    address = ipaddress.ip_address(host)
  except ValueError:  # a host name: it may resolve anywhere
    return False
  mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
  return (mapped or address).is_loopback


def exposure_warning(
  host: str, endpoint: str = "the JetStream endpoint", authenticated: bool = False
) -> str | None:
  """The warning for serving `endpoint` on `host`, or None when `host` is loopback only.

  Anyone who can reach the address can run the policy (and, with the HTTP
  endpoint, write training data) unless the endpoint checks a key; nothing
  is encrypted either way.
  """
  if is_loopback(host):
    return None
  auth = (
    "checks an API key but is unencrypted"
    if authenticated
    else ("is unauthenticated and unencrypted")
  )
  return (
    f"serving on {host}, beyond loopback: {endpoint} {auth} (no TLS); anyone who can "
    "reach it can query the policy. "
    f"Use --host={LOOPBACK_HOST} and a tunnel, or a proxy with TLS and auth."
  )
