"""``gradwatch keys DIR``: make the CURVE key files (see :mod:`gradwatch.auth` for their layout)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, CliPositionalArg, SettingsConfigDict

from gradwatch.auth import make_keys

from .errors import UsageError


class KeysCommand(BaseSettings):
    """Make CURVE keys: a server pair for the aggregator and client pairs for the agents."""

    model_config = SettingsConfigDict(
        env_prefix="GRADWATCH_KEYS_", extra="forbid", frozen=True, cli_kebab_case=True,
        cli_prog_name="gradwatch keys", cli_implicit_flags=True,
    )

    dir: CliPositionalArg[Path] = Field(description="Directory to write the keys into (created 0700 if missing).")
    client: list[str] = Field(
        ["client"],
        description="Client key pair to make, by name; repeat for one pair per agent group (default: one pair, 'client', shared by all agents).",
    )
    force: bool = Field(False, description="Replace existing key files.")

    def cli_cmd(self) -> None:
        try:
            paths = make_keys(self.dir, self.client, self.force)
        except (ValueError, OSError) as e:
            raise UsageError(str(e)) from None
        d = self.dir
        print(f"wrote {len(paths)} files to {d}/ (secret files 0600):")
        for name, p in paths.items():
            kind = "secret" if name.endswith("key_secret") else "public"
            print(f"  {kind}  {p}")
        print("\naggregator (keep server.key_secret on its host only):")
        print(f"  gradwatch aggregator --listen tcp://0.0.0.0:5555 --server-key {d}/server.key_secret --client-keys {d}/clients")
        print("agents (copy server.key and their .key_secret to the training hosts):")
        print(f"  GRADWATCH_SERVER_KEY={d}/server.key GRADWATCH_CLIENT_KEY={d}/{self.client[0]}.key_secret")
