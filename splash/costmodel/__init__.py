"""Cost model (paper App. B): predicted step time per layout and switch cost, from a hardware profile. No torch."""
from splash.costmodel.policy import choose_layout
from splash.costmodel.profile import Collective, HardwareProfile, load_profile, profile_from_dict
from splash.costmodel.step_cost import CostModel, RowLoad, StepPrediction, SwitchPrediction

__all__ = ["Collective", "CostModel", "HardwareProfile", "RowLoad", "StepPrediction", "SwitchPrediction",
           "choose_layout", "load_profile", "profile_from_dict"]
