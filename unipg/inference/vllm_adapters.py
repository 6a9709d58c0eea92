"""The LoRA adapters a ``VLLMEngine`` serves: one per weights version, or with one adapter per role of a multi-role
task (``agent.role_policy: adapters``) one per role per version.

A version's adapters are saved in PEFT format in a folder of their own (PEFT writes a role's adapter into the
subfolder named after it), and each gets a ``LoRARequest`` with a new id: vLLM caches adapters by id, so a new
id makes it read the new weights. Once a version is in use the older ones are removed from vLLM and from disk (no
request in flight uses them: a load waits for them, or interrupts and resubmits them under the new adapters).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from unipg.policy.adapters import role_adapter_names, save_adapter


class AdapterVersions:
    """The ``LoRARequest`` of each adapter of the version vLLM serves, and the folders they are read from."""

    def __init__(self, llm, folder: Path, roles: list[str]):
        self.llm, self.folder, self.roles = llm, folder, list(roles)  # roles: empty for PEFT's one adapter
        self._requests: dict[str | None, object] = {}  # role (None: the one adapter) → its LoRARequest
        self._on_disk: list[Path] = []
        self._saved = self._ids = 0  # versions saved (their folders' names), and adapter ids given

    @classmethod
    def of(cls, llm, folder: Path, model) -> AdapterVersions:
        return cls(llm, folder, role_adapter_names(model))

    def save(self, model) -> Path:
        """Write every adapter of ``model`` into a new folder (each role's in ``<folder>/<role>``); returns it."""
        self._saved += 1
        return save_adapter(model, self.folder / f"adapter-{self._saved}")

    def use(self, version: int, folder: Path) -> None:
        """Serve the adapters saved in ``folder`` (on the engine's thread, between requests) and drop the older."""
        from vllm.lora.request import LoRARequest

        requests = {}
        for role in self.roles or [None]:
            self._ids += 1
            path, name = (folder, f"unipg-v{version}") if role is None else (folder / role, f"unipg-v{version}-{role}")
            requests[role] = LoRARequest(f"{name}-{self._ids}", self._ids, str(path))
        old, self._requests = self._requests, requests
        for request in old.values():
            self.llm.remove_lora(request.lora_int_id)
        for old_folder in self._on_disk:
            shutil.rmtree(old_folder, ignore_errors=True)
        self._on_disk = [folder]

    def request(self, role: str | None = None):
        """The current ``LoRARequest`` for a request of ``role`` (None: the model's one adapter)."""
        if (role is None) != (not self.roles) or (role is not None and role not in self.roles):
            have = f"one adapter per role ({', '.join(self.roles)})" if self.roles else "one adapter, for every role"
            raise ValueError(f"a request for role {role!r} on a model with {have}")
        return self._requests[role]
