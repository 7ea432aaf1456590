"""What an update rule tells the engine, and nothing of any one optimizer: each
optimizer's file (adamw.py, sgd.py, lion.py, muon.py, normuon.py) holds its class and
its rule, a subclass of Rule. The functional core (functional.py), the Plan, offload, DTensor state
and checkpoints serve every rule through this interface; the C kernels' element
update is chosen by the rule's name (op_args' `rule`, precis.h's precis_rule_t).

A Rule says which moments a param's state keeps, the op arguments of a param group,
torch's constructor checks for that optimizer, and torch's name of each state key
(to_torch_state_dict)."""

from .state_layout import one_state_layout


class Rule:
    """The interface, with the defaults most rules share: the param's state laid out as
    the policy says, an elementwise step planned flat, torch's state key names."""

    name = None  # its name: the kernel's rule (op_constants.RULES) for elementwise ones
    flat = True  # a group's steady state may be planned flat (step_plan)
    first_step_starts_momentum = False  # SGD: the kernel's step 1 starts the buffer from g
    # Muon: its step needs each param whole (Newton-Schulz), not elementwise; precis.ddp
    # then hands every rank a piece of each param that can assemble it (_precis_whole).
    steps_whole_params = False
    all_moments = ()  # the moments its state may hold
    row_state = None  # the key of a per-row state it keeps (state_layout.ROW_STATE_KEYS)
    torch_names = {}  # precis state key -> torch's key for this optimizer, where they differ
    group_keys = ("lr",)  # a saved param group holds these
    # Options the rule gained later: a saved group without one stepped with this value
    # (optim_checkpoint gives it that, not the optimizer's).
    saved_defaults = {}

    def for_group(self, group):
        """The rule that steps a param group: this one, or another a group may ask for
        by its "algorithm" key (Muon's and NorMuon's groups of 1-D params, embeddings
        and the head: "adamw")."""
        return self

    def moments(self, group):
        """The moment keys a param's state keeps under the group's settings now."""
        raise NotImplementedError

    def required(self):
        """The keys every saved state of a param holds (a torch state dict's too)."""
        return ()

    def layout(self, layout, policy):
        """The state_layout.Layout of a param under this rule, from the policy's."""
        return layout

    def check_stepped(self, p, where):
        """A param as the step gets it (a precis.ddp piece, say) that this rule cannot
        step: ValueError naming it, before anything is written."""

    def op_args(self, group):
        """The op's hyperparameters of a group, but lr and seed (step_calls)."""
        raise NotImplementedError

    def check(self, group, where):
        """torch's constructor checks of the group's hyperparameters (ValueError), which
        every step makes again."""
        raise NotImplementedError

    def check_added(self, group, where):
        """torch's constructor checks that its step does not make again: a group as it
        is made or added (a scheduler may change it after)."""


class OneState(Rule):
    """A rule with one state buffer, its momentum: 'exp_avg' in the policy's
    momentum_dtype (exp_avg_dtype where the policy predates it), no exp_avg_sq."""

    torch_names = {"exp_avg": "momentum_buffer"}
    all_moments = ("exp_avg",)

    def moments(self, group):
        return ("exp_avg",)

    def required(self):
        return ("exp_avg",)

    def layout(self, layout, policy):
        return one_state_layout(layout, policy)
