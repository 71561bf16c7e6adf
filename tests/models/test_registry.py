"""Registry, configs and input validation: what a person sees when they get something wrong."""

import pytest
import torch

from models.contract import DetectorConfig
from models.parity import random_events, step_vs_forward_error
from models.registry import REGISTRY, build_detector, config_class
from pipeline.features import FEATURE_NAMES
from tests.models.helpers import DETECTORS, make_detector


def test_registry_names_the_three_detectors_and_the_hybrid():
    assert set(REGISTRY) == {"lstm", "transformer", "linear_transformer", "hybrid"}
    for name, (config_type, detector_type) in REGISTRY.items():
        assert detector_type.name == name and issubclass(config_type, DetectorConfig)


@pytest.mark.parametrize("name", DETECTORS)
def test_default_configs_are_the_documented_size(name):
    config = config_class(name)()
    assert (config.d_model, config.num_layers, config.num_features, config.terminal_buckets) == (
        64,
        2,
        len(FEATURE_NAMES),  # every feature the featurizer computes
        4096,
    )
    assert getattr(config, "num_heads", 4) == 4
    assert getattr(config, "window_events", 64) == 64


@pytest.mark.parametrize("name", DETECTORS)
def test_config_travels_as_a_dict_and_rebuilds_the_same_detector(name):
    detector = make_detector(name)
    values = detector.config.to_dict()
    rebuilt = build_detector(name, values)
    assert rebuilt.config == detector.config
    rebuilt.load_state_dict(detector.state_dict())
    x = random_events(detector, 2, 9).float()
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(x)[0], detector.float()(x)[0])
    assert build_detector(name).config == config_class(name)()
    assert config_class(name).tiny().fingerprint() != config_class(name)().fingerprint()


def test_mistakes_raise_errors_that_say_what_to_do():
    with pytest.raises(
        ValueError,
        match=r"unknown detector 'gru'; known detectors: \['hybrid', 'linear_transformer', 'lstm', 'transformer'\]",
    ):
        build_detector("gru")
    with pytest.raises(ValueError, match=r"no field\(s\) \['window_events'\]"):
        build_detector("lstm", {"window_events": 8})
    with pytest.raises(TypeError, match="takes a LSTMConfig, got a TransformerConfig"):
        build_detector("lstm", config_class("transformer")())
    with pytest.raises(ValueError, match=r"d_model = 10 must be a multiple of num_heads = 4"):
        config_class("transformer")(d_model=10)
    with pytest.raises(ValueError, match=r"num_layers = 0: expected an integer >= 1"):
        config_class("lstm")(num_layers=0)
    with pytest.raises(ValueError, match=r"num_layers = True: expected an integer >= 1"):
        config_class("lstm")(num_layers=True)
    with pytest.raises(ValueError, match=r"LSTMConfig.encoder_ffn = 'false': expected true or false"):
        config_class("lstm").from_dict({"encoder_ffn": "false"})


@pytest.mark.parametrize("name", DETECTORS)
def test_bad_inputs_are_named(name):
    detector = make_detector(name)
    x = random_events(detector, 2, 5)
    with pytest.raises(
        ValueError, match=r"expected input of shape \[B, T, F\] with F = 6 .* got \[2, 5, 5\]"
    ):
        detector(x[..., 1:])
    with pytest.raises(ValueError, match=r"expected input of shape \[B, F\]"):
        detector.step(x, detector.init_state(2))
    x[1, 3, -1] = 16  # one past the last bucket
    with pytest.raises(ValueError, match=r"terminal bucket index 16 is outside \[0, 16\)"):
        detector(x)
    with pytest.raises(
        ValueError, match=r"lengths must be \[B\] = \[2\] integers in \[0, T = 5\], got \[6, 1\]"
    ):
        detector(x, lengths=torch.tensor([6, 1]))


@pytest.mark.parametrize("name", DETECTORS)
def test_the_terminal_bucket_is_embedded_only_when_the_config_asks(name):
    plain = make_detector(name)
    embedded = make_detector(name, terminal_embedding=True)
    assert not any("terminal" in key for key in plain.state_dict())
    assert any("terminal" in key for key in embedded.state_dict())
    x = random_events(plain, 3, 7, seed=1)
    moved = x.clone()
    moved[..., -1] = (moved[..., -1] + 5) % plain.config.terminal_buckets  # every event at another terminal
    with torch.inference_mode():
        assert torch.equal(plain(x)[0], plain(moved)[0])  # without an embedding the bucket changes nothing
        assert not torch.equal(embedded(x)[0], embedded(moved)[0])
        assert step_vs_forward_error(embedded, x) < 1e-9  # the embedded path keeps the contract too
    x[0, 2, -1] = -1  # out of range is refused either way
    for detector in (plain, embedded):
        with pytest.raises(ValueError, match=r"terminal bucket index -1 is outside \[0, 16\)"):
            detector(x)


def test_linear_transformer_decay_is_a_rule_or_one_number_per_head_and_says_what_it_expects():
    config_type = config_class("linear_transformer")
    assert config_type().decay_per_event == "mixed"
    assert config_type().head_decays() == (0.75, 0.9375, 0.984375, 1.0)
    assert config_type(decay_per_event="none").head_decays() == (1.0,) * 4
    # The state's layout is the same whatever the decay, its meaning is not: the config fingerprint in
    # every state record tells them apart, so a record written under another decay is refused.
    assert config_type(decay_per_event="none").fingerprint() != config_type().fingerprint()
    # A list (JSON, YAML) becomes a tuple: the config stays hashable and equal after its round trip.
    listed = config_type(num_heads=2, d_model=8, decay_per_event=[0.5, 1])
    assert listed.decay_per_event == (0.5, 1.0) and hash(listed) == hash(
        config_type.from_dict(listed.to_dict())
    )
    expected = r"expected one of \['mixed', 'none', 'retnet'\] or 4 numbers in \(0, 1\], one per head"
    for wrong in ("fast", (0.5, 0.9), (0.5, 0.9, 1.0, 0.0), (0.5, 0.9, 1.0, 1.5), ("a", "b", "c", "d")):
        with pytest.raises(ValueError, match=rf"decay_per_event = .*: {expected}"):
            config_type(decay_per_event=wrong)


def test_a_linear_transformer_config_saved_before_decay_existed_rebuilds_an_undecayed_detector():
    values = config_class("linear_transformer").tiny().to_dict()
    del values["decay_per_event"]  # as an artifact written before the field existed holds it
    old = build_detector("linear_transformer", values)
    assert old.config.head_decays() == (1.0, 1.0)
    decayed = make_detector("linear_transformer", seed=0)
    assert decayed.config.head_decays() == (0.75, 1.0)
    old.load_state_dict(decayed.state_dict())
    x = random_events(decayed, 2, 20, seed=2)
    with torch.no_grad():  # the same weights, another detector: the decay is in use
        assert (old.double()(x)[0] - decayed(x)[0]).abs().max().item() > 1e-3


# Fingerprints of the default configs as released before `encoder_ffn` existed: the state records those
# detectors wrote carry them, and must still load. Every detector then read 26 features (27 since the amount
# itself joined its log) clipped at 10 (100 since), and the linear Transformer trained with dropout 0.1.
RELEASED_FINGERPRINTS = {
    "lstm": "4f2154e5758e9432",
    "linear_transformer": "3df8269f934ae89c",
    "transformer": "1f6f36833fe1fe2c",
    "hybrid": "ce600a4e1c05570a",
}
RELEASED_DEFAULTS_SINCE_CHANGED = {
    name: {
        "num_features": 26,
        "input_clip": 10.0,
        **({"dropout": 0.1} if name == "linear_transformer" else {}),
    }
    for name in RELEASED_FINGERPRINTS
}


@pytest.mark.parametrize("name", DETECTORS)
def test_an_encoder_ffn_keeps_the_contract_and_configs_without_it_their_fingerprint(name):
    config_type = config_class(name)
    released = config_type(encoder_ffn=False, **RELEASED_DEFAULTS_SINCE_CHANGED.get(name, {}))
    assert released.fingerprint().hex() == RELEASED_FINGERPRINTS[name]
    saved = released.to_dict()
    del saved["encoder_ffn"]  # a config saved before the field existed rebuilds the detector it described
    assert config_type.from_dict(saved) == released
    assert config_type(encoder_ffn=True).fingerprint() != released.fingerprint()

    torch.manual_seed(0)
    detector = build_detector(name, config_type.tiny(encoder_ffn=True).to_dict()).double()
    x = random_events(detector, 3, 12)
    assert step_vs_forward_error(detector, x) < 1e-9
    plain = build_detector(name, config_type.tiny(encoder_ffn=False).to_dict())
    assert sum(p.numel() for p in detector.parameters()) > sum(p.numel() for p in plain.parameters())
