"""Agent-side rail-v1 library: upload per-step samples of agent sessions to a gateway or an RL Service.

`TrajectoryUploader` (uploader.py) queues samples and sends them as rail-v1 batches (CONTRACT §2.9, §4.6) with
back-pressure and retries; `RLOnlineRail` (agent_rail.py) is the per-turn hook an agent loop calls. Nothing here imports
the RL Service or the gateway; the only project imports are two of common/: the HMAC signer every signed client uses
(`HmacAuth`, common/hmac_signing.py) and the agent's key (`SigningKey`, common/signing_keys.py).
"""

from .agent_rail import RLOnlineRail
from .uploader import TrajectoryUploader, UploaderClosed, UploaderMetrics

__all__ = ["RLOnlineRail", "TrajectoryUploader", "UploaderClosed", "UploaderMetrics"]
