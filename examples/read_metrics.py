"""Read the plugin's ``vllm_kvevict_*`` metrics from the server's ``/metrics`` (docs/observability.md).

    python examples/read_metrics.py [--base-url http://127.0.0.1:8000/v1]

Parsed with prometheus_client's text parser (a dependency of vllm-kvevict). Prints the active setting
(``vllm_kvevict_config_info``), the gauges of what running requests hold now, and the counters so far.
"""

from __future__ import annotations

import argparse
import os
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "vllm_kvevict_"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    args = parser.parse_args()

    metrics_url = args.base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    families = [family for family in text_string_to_metric_families(text) if family.name.startswith(PREFIX)]
    for family in families:
        if family.name == PREFIX + "config_info":
            for sample in family.samples:
                print(f"setting: method={sample.labels['method']} budget={sample.labels['budget']}")
    for kind in ("gauge", "counter"):
        for family in families:
            if family.type != kind or family.name == PREFIX + "config_info":
                continue
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = ",".join(f"{key}={value}" for key, value in sorted(sample.labels.items()))
                print(f"{kind} {sample.name}{{{labels}}} = {sample.value:g}")


if __name__ == "__main__":
    main()
