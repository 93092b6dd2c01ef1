"""A training client that trains a step and saves sampler weights, over and over, until killed.

    python -m tests.lifecycle.save_loop URL POLICY      (the API key comes in $TINKER_API_KEY)

Prints one line per finished save, so the test can see how far it got.
"""

from __future__ import annotations

import sys

import tinker

from tests.service.live import train


def main() -> None:
    url, policy = sys.argv[1:3]
    client = tinker.ServiceClient(base_url=url)
    base_model = client.get_server_capabilities().supported_models[0].model_name
    tc = client.create_lora_training_client(base_model=base_model, rank=4, user_metadata={"policy": policy}).result()
    i = 0
    while True:
        train(tc, 1)
        print(tc.save_weights_for_sampler(f"s{i}").result().path, flush=True)
        i += 1


if __name__ == "__main__":
    main()
