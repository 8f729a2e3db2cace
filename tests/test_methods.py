"""Methods describe themselves: a module in privacy/, attacks/ or pruning/policies/ is registered by
being there, every registered defense, attack and pruning policy declares what the rest of the
system reads of it, and the paradigms and threat models are registered with their properties."""

import importlib
import inspect
import pkgutil
import sys
from dataclasses import MISSING, asdict, fields, is_dataclass

import pytest

from attacks import ATTACKS, Attack
from attacks.base import KINDS, READS, THREAT_MODELS as ATTACKER_MODELS
from config.schema import PruningConfig
from config.threats import THREAT_MODELS
from privacy import DEFENSES, EDGE, STAGES, Defense, client_stages, stage_paradigms
from privacy.dp import MODES, mode_paradigms
from pruning import POLICIES, PRUNING_PROFILES
from training.model import CLIENT, SERVER, party_owners
from vlm.paradigms import PARADIGMS
from vlm.profiles import PROFILES

# Each package whose modules register methods, and the kind of thing a module of it registers.
PACKAGES = {"privacy": Defense, "attacks": Attack, "pruning.policies": None}


def package_modules(package: str) -> list[str]:
    path = importlib.import_module(package).__path__
    return [f"{package}.{info.name}" for info in pkgutil.iter_modules(path) if info.name != "__main__"]


@pytest.mark.parametrize("package", PACKAGES)
def test_importing_a_package_imports_every_module_of_it(package):
    """No import list to extend: the package's __init__ imports each of its modules."""
    assert [name for name in package_modules(package) if name not in sys.modules] == []


@pytest.mark.parametrize(("package", "registry"), [("privacy", DEFENSES), ("attacks", ATTACKS)])
def test_every_method_class_a_module_defines_is_registered(package, registry):
    base = PACKAGES[package]
    defined = [cls for name in package_modules(package)
               for _, cls in inspect.getmembers(sys.modules[name], inspect.isclass)
               if issubclass(cls, base) and cls.__module__ == name and not inspect.isabstract(cls)]
    assert defined
    assert [cls.__name__ for cls in defined if cls.name not in registry or registry.get(cls.name) is not cls] == []


def test_every_policy_module_registers_a_policy():
    modules = [name for name in package_modules("pruning.policies") if name != "pruning.policies.base"]
    registering = {policy.build.__module__ for policy in POLICIES}
    assert set(modules) == registering


def declares(method, attribute: str) -> bool:
    """Whether the class itself or a method class it derives from (not the interface) sets `attribute`."""
    return any(attribute in vars(cls) for cls in type.mro(method) if cls not in (Defense, Attack, object))


def check_options(options: type) -> None:
    assert is_dataclass(options) and callable(getattr(options, "validate", None))
    assert all(f.default is not MISSING or f.default_factory is not MISSING for f in fields(options)), \
        f"{options.__name__}: every option has a default"
    options().validate()


@pytest.mark.parametrize("defense", list(DEFENSES), ids=DEFENSES.names())
def test_every_defense_declares_its_stage_its_strength_and_its_options(defense):
    assert defense.stage in STAGES and declares(defense, "strength")
    check_options(defense.Options)
    strength = defense.strength_option(defense.Options())
    assert strength is None or strength in asdict(defense.Options())


@pytest.mark.parametrize("attack", list(ATTACKS), ids=ATTACKS.names())
def test_every_attack_declares_its_kind_what_it_reads_and_its_headline(attack):
    assert all(declares(attack, name) for name in ("threat_model", "kind", "reads", "headline"))
    assert attack.threat_model in ATTACKER_MODELS and attack.kind in KINDS
    assert attack.reads and set(attack.reads) <= set(READS)
    assert attack.headline and all(isinstance(metric, str) for metric in attack.headline)
    assert is_dataclass(attack.Options)


@pytest.mark.parametrize("policy", list(POLICIES), ids=POLICIES.names())
def test_every_policy_declares_its_options_and_its_budget(policy):
    check_options(policy.Options)
    assert policy.budget is None or policy.budget in asdict(policy.Options())


def test_a_policy_option_is_the_run_config_key_of_its_name_with_its_default():
    """A policy's options are `pruning.<option>` keys: the schema declares each, with the policy's default."""
    defaults = asdict(PruningConfig())
    for policy in POLICIES:
        for option, default in asdict(policy.Options()).items():
            assert defaults.get(option, MISSING) == default, f"pruning.{option} of policy {policy.name}"


def test_registration_refuses_a_method_that_does_not_describe_itself():
    class Unstaged(Defense):
        name, stage, strength, Options = "unstaged", "nowhere", None, DEFENSES.get("noise").Options

        def apply(self, payload, seed):
            return None

    with pytest.raises(ValueError, match="stage='nowhere'"):
        DEFENSES.register(Unstaged)

    class Undialled(Unstaged):
        name, stage, strength = "undialled", "activation", "loudness"

    with pytest.raises(ValueError, match="strength='loudness'; allowed: None or an option of NoiseOptions: variance"):
        DEFENSES.register(Undialled)

    class Unread(Attack):
        name, threat_model, kind, reads, headline = "unread", "passive", "image", (), ("psnr",)

    with pytest.raises(ValueError, match="reads=()"):
        ATTACKS.register(Unread)
    assert not {"unstaged", "undialled"} & set(DEFENSES.names()) and "unread" not in ATTACKS


def test_every_model_profile_has_its_pruning_profile():
    """Keyed by the model profiles' registry: one pruning profile per model profile, none else."""
    assert set(PRUNING_PROFILES.names()) == set(PROFILES.names())
    assert all(profile.model is PROFILES.get(profile.name) for profile in PRUNING_PROFILES)


def test_the_paradigms_say_what_each_party_holds():
    assert PARADIGMS.names() == ["cl", "fl", "sl", "usl", "mtv"]
    owners = {(p.name, role): party_owners(p, role) for p in PARADIGMS for role in (CLIENT, SERVER)}
    assert owners == {("cl", CLIENT): ("all",), ("fl", CLIENT): ("all",), ("mtv", CLIENT): ("all",),
                      ("sl", CLIENT): ("client",), ("usl", CLIENT): ("head", "tail"), ("sl", SERVER): ("server",),
                      ("usl", SERVER): ("body",), ("cl", SERVER): (), ("fl", SERVER): (), ("mtv", SERVER): ()}
    assert {p.name: p.cut_layers(4, (2, 6)) for p in PARADIGMS} == {"cl": (), "fl": (), "sl": (4,), "usl": (2, 6),
                                                                     "mtv": ()}


def test_stages_modes_and_threat_models_follow_from_the_paradigms_properties():
    assert {stage: stage_paradigms(stage) for stage in STAGES} == {
        "activation": ["sl", "usl"], "gradient": ["usl"], "loss": ["sl", "usl"], EDGE: ["sl", "usl"]}
    assert client_stages(PARADIGMS.get("usl")) == tuple(STAGES)
    assert {mode: mode_paradigms(mode) for mode in MODES} == {
        "off": ("cl", "fl", "sl", "usl", "mtv"), "central": ("fl",), "central-adaptive": ("fl",),
        "central-client-clipping": ("fl",), "local": ("fl",), "sgd": ("cl", "fl", "sl", "usl")}
    applies = {model.name: [p.name for p in PARADIGMS if model.applies_to(p)] for model in THREAT_MODELS}
    assert applies == {"none": ["cl", "fl", "sl", "usl", "mtv"], "passive": ["fl", "sl", "usl", "mtv"],
                       "active-fsha": ["sl", "usl"]}
