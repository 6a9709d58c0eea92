"""The one check of sampling parameters, as the run's ``sample`` settings meet it: refused before anything runs,
naming the setting and what to use."""

import pytest

from unipg.config import ConfigError, load_config
from unipg.config.sampling import MIN_TEMPERATURE


@pytest.mark.parametrize(
    "override, phrases",
    [
        (
            "sample.temperature=1e-300",
            ["'sample.temperature'", "smallest positive temperature is 0.01", "0 for greedy"],
        ),
        ("sample.temperature=0.001", ["'sample.temperature'", "0.001 is too small"]),
        ("sample.temperature=-1", ["'sample.temperature'"]),
        ("sample.stop=['']", ["'sample.stop'", "stop strings must not be empty"]),
        ("sample.top_k=0", ["'sample.top_k'"]),
    ],
)
def test_sampling_settings_the_sampler_cannot_use_are_config_errors(override, phrases):
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["task.name=calculator", override])
    for phrase in phrases:
        assert phrase in str(refused.value)


def test_greedy_and_the_smallest_temperature_are_accepted():
    for temperature in (0.0, MIN_TEMPERATURE, 2.5):
        config = load_config(None, ["task.name=calculator", f"sample.temperature={temperature}"])
        assert config.sample.temperature == temperature
