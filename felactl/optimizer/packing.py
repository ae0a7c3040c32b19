"""Packing spanning arborescences (Blink, SEEDS.md section 4): the LP and the fewest-trees ILP.

Pure (stdlib + networkx + pulp). Works on a directed capacity graph (``felactl.optimizer.graph``)
and a root; knows nothing of clusters. The arborescences themselves (the cheapest, every one of a
small graph) are found in :mod:`felactl.optimizer.arborescences`.

1. **Columns.** A few rounds of multiplicative weights (Garg-Koenemann): take the minimum-length
   spanning arborescence from the root (Edmonds' algorithm:
   :func:`arborescences.min_cost_arborescence`), then lengthen its edges by
   ``1 + eps * bottleneck / capacity``. This yields diverse, good trees.
2. **Packing LP with column generation** (:func:`solve_packing_lp`, :func:`pack_trees`) over
   those trees; the pricing problem is again a minimum-cost arborescence, with the LP's dual
   prices as edge costs. It stops when no tree has a negative reduced cost (the LP optimum over
   *all* trees) or when the rate reaches the min-cut bound, which by Edmonds' theorem is that
   optimum.
3. **Peeling** (:func:`peel_trees`): an LP optimum spreads its rate over many trees, so we also
   build a packing of few trees greedily, each round taking the tree that can carry the most
   while the rest still packs (checked with min-cuts, :func:`max_safe_weight`).
4. **Fewest-trees ILP** (:func:`fewest_trees_ilp`), warm-started from the peeled trees, over
   every tree steps 2-3 produced, or, where the group is small enough to list every
   arborescence (``arborescences.ENUMERATION_LIMIT``), over all of them, which makes the count the true
   minimum: keep as few trees as possible that still carry ``min_share`` of the packed rate.

**Two-way packing** (``two_way=True``), for an allreduce that reduces up each tree and broadcasts
down it at once: a tree then loads each of its links both ways, so link (u, v) carries the rate
of every tree that holds (u, v) *or* (v, u). Steps 1, 2 and 4 run with that load (a tree's price
is then y_uv + y_vu per edge); peeling's cut test is the broadcast's and is skipped: the fewest
trees start from the LP's. Only links whose reverse exists take part (the reduce comes back on
it). Where links are as wide both ways, the LP optimum is Nash-Williams' bound of fractional
spanning-tree packing, min over partitions P of (width crossing P) / (|P| - 1): what any
allreduce can reach there (:func:`felactl.optimizer.graph.allreduce_bound`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import networkx as nx
import pulp

from felactl.errors import PlanInfeasible
from felactl.optimizer.arborescences import Edges, all_arborescences, min_cost_arborescence

SOLVER_TIME_LIMIT_S = 20
FEWEST_TREES_TIME_LIMIT_S = 3
"""The ILP starts from the peeled trees, so when time runs out it still has a good answer."""
MWU_ROUNDS_PER_NODE = 3
MWU_EPSILON = 0.5
MAX_PRICING_ROUNDS = 200
REDUCED_COST_TOLERANCE = 1e-7
BOUND_TOLERANCE = 1e-6
CAPACITY_EPS_GBPS = 1e-7

_names = itertools.count()


def warm_start_trees(graph: nx.DiGraph, root) -> list[Edges]:
    """Distinct trees from a few multiplicative-weights rounds (step 1 of the module docstring)."""
    capacity = {(u, v): d["capacity"] for u, v, d in graph.edges(data=True)}
    length = {edge: 1.0 / cap for edge, cap in capacity.items()}
    trees: list[Edges] = []
    for _ in range(MWU_ROUNDS_PER_NODE * graph.number_of_nodes()):
        tree = min_cost_arborescence(graph, root, length)
        if tree not in trees:
            trees.append(tree)
        bottleneck = min(capacity[e] for e in tree)
        for edge in tree:
            length[edge] *= 1.0 + MWU_EPSILON * bottleneck / capacity[edge]
    return trees


def _variable(problem: pulp.LpProblem, name: str, **bounds) -> pulp.LpVariable:
    """A variable of ``problem`` (PuLP >= 3.3 attaches it to the model; older PuLP builds it alone)."""
    add = getattr(problem, "add_variable", None)
    return add(name, **bounds) if add else pulp.LpVariable(name, **bounds)


def _dual_price(problem: pulp.LpProblem, name: str) -> float:
    getter = getattr(problem, "get_constraint_by_name", None)
    constraint = getter(name) if getter else problem.constraints[name]
    return constraint.pi or 0.0


def _solve(
    problem: pulp.LpProblem,
    what: str,
    time_limit_s: float = SOLVER_TIME_LIMIT_S,
    warm_start: bool = False,
    cuts: bool | None = None,
) -> None:
    problem.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, warmStart=warm_start, cuts=cuts))
    status = pulp.LpStatus[problem.status]
    found = pulp.LpSolution.get(problem.sol_status, "")
    if status != "Optimal" and found != "Optimal Solution Found":
        raise PlanInfeasible(f"{what}: the solver returned {status} ({found or 'no solution'})")


def loaded_links(tree: Edges, two_way: bool) -> frozenset:
    """The directed links a tree loads: its edges, and (two-way) their reverses."""
    return frozenset(tree) | frozenset((v, u) for u, v in tree) if two_way else frozenset(tree)


def two_way_graph(graph: nx.DiGraph) -> nx.DiGraph:
    """The links of ``graph`` whose reverse it has too: what a two-way packing may use."""
    kept = nx.DiGraph()
    kept.add_nodes_from(graph.nodes)
    kept.add_edges_from((u, v, d) for u, v, d in graph.edges(data=True) if graph.has_edge(v, u))
    return kept


def _capacity_rows(problem: pulp.LpProblem, graph: nx.DiGraph, loads: dict) -> dict[tuple, str]:
    """Add "for every link e: the rates of the columns loading e sum to at most c_e" to ``problem``
    (``loads``: column variable -> the links it loads); returns each constrained link's row name."""
    names = {}
    for e, (u, v, data) in enumerate(graph.edges(data=True)):
        users = [var for var, links in loads.items() if (u, v) in links]
        if users:
            names[(u, v)] = f"c1_capacity_{e}"
            problem += (pulp.lpSum(users) <= data["capacity"], names[(u, v)])
    return names


def _kept_rows(problem: pulp.LpProblem, graph: nx.DiGraph, trees, kept: dict, rate: dict, two_way: bool) -> None:
    """Add "a tree carries nothing unless kept, and at most its narrowest loaded link" (w_T <= u_T z_T)."""
    capacity = {(u, v): d["capacity"] for u, v, d in graph.edges(data=True)}
    for t, tree in enumerate(trees):
        narrowest = min(capacity[e] for e in loaded_links(tree, two_way))
        problem += (rate[tree] <= narrowest * kept[tree], f"c2_kept_{t}")


def solve_packing_lp(graph: nx.DiGraph, trees: list[Edges], two_way: bool = False) -> tuple[dict[Edges, float], dict]:
    """The packing LP over the given trees; returns (rate of each tree GB/s, dual price of each edge).

    Sets: E the directed links (capacity c_e, GB/s); T the candidate spanning arborescences.
    Variables: w_T >= 0, the rate tree T carries (GB/s).
    Objective: maximise sum_T w_T (the broadcast rate).
    Constraints: (1) for every link e: sum over trees T loading e of w_T <= c_e (T loads its
    edges; two-way, their reverses too).
    The dual price y_e of (1) prices link e; a tree with sum_{e loaded} y_e < 1 would improve it.
    """
    problem = pulp.LpProblem(f"tree_packing_{next(_names)}", pulp.LpMaximize)
    rate = {tree: _variable(problem, f"w_{t}", lowBound=0) for t, tree in enumerate(trees)}
    problem += pulp.lpSum(rate.values())
    names = _capacity_rows(problem, graph, {rate[t]: loaded_links(t, two_way) for t in trees})
    _solve(problem, "tree packing LP")
    weights = {tree: var.value() or 0.0 for tree, var in rate.items()}
    duals = {edge: _dual_price(problem, names[edge]) if edge in names else 0.0 for edge in graph.edges}
    return weights, duals


def pack_trees(
    graph: nx.DiGraph, root, bound_gbps: float, known: list[Edges] = (), two_way: bool = False
) -> tuple[list[Edges], dict[Edges, float]]:
    """Column generation (step 2): every tree generated, and the optimal rate of each.

    ``known`` trees that still fit the graph join the warm-start columns.
    """
    trees = [t for t in known if all(graph.has_edge(*e) for e in t)]
    trees += [t for t in warm_start_trees(graph, root) if t not in trees]
    for _ in range(MAX_PRICING_ROUNDS):
        weights, duals = solve_packing_lp(graph, trees, two_way)
        if sum(weights.values()) >= bound_gbps * (1 - BOUND_TOLERANCE):
            break
        price = {e: max(y, 0.0) for e, y in duals.items()}
        if two_way:  # a tree loads its edges both ways
            price = {(u, v): y + price.get((v, u), 0.0) for (u, v), y in price.items()}
        priced = min_cost_arborescence(graph, root, price)
        if sum(price[e] for e in priced) >= 1 - REDUCED_COST_TOLERANCE or priced in trees:
            break
        trees.append(priced)
    return trees, weights


def fewest_trees_ilp(
    graph: nx.DiGraph,
    trees: list[Edges],
    packed_gbps: float,
    min_share: float,
    start: dict[Edges, float] | None = None,
    two_way: bool = False,
) -> dict[Edges, float]:
    """The fewest trees that carry ``min_share`` of the packed rate; returns the kept trees' rates.

    Sets: E the directed links (capacity c_e); T the generated trees; u_T = min c_e over the links
    T loads (its edges; two-way, their reverses too).
    Variables: z_T in {0, 1} (tree kept); w_T >= 0 its rate (GB/s).
    Objective: minimise sum_T z_T - 0.5 * sum_T w_T / R, R the packed rate (fewest trees first;
    the second term < 1 only breaks ties towards the fastest of the smallest sets).
    Constraints: (1) for every link e: sum over T loading e of w_T <= c_e;
    (2) for every tree T: w_T <= u_T z_T; (3) sum_T w_T >= min_share * R.
    ``start`` (tree -> rate), a feasible solution, warm-starts CBC, which then runs without its
    cut generators (on 8 DGX-1V GPUs: 0.03 s of CPU where they took 0.47 s, to the same trees).
    """
    problem = pulp.LpProblem(f"fewest_trees_{next(_names)}", pulp.LpMinimize)
    kept = {tree: _variable(problem, f"z_{t}", cat="Binary") for t, tree in enumerate(trees)}
    rate = {tree: _variable(problem, f"w_{t}", lowBound=0) for t, tree in enumerate(trees)}
    problem += pulp.lpSum(kept.values()) - 0.5 * pulp.lpSum(rate.values()) * (1.0 / packed_gbps)
    _capacity_rows(problem, graph, {rate[t]: loaded_links(t, two_way) for t in trees})
    _kept_rows(problem, graph, trees, kept, rate, two_way)
    problem += (pulp.lpSum(rate.values()) >= min_share * packed_gbps, "c3_share")
    for tree in trees:
        kept[tree].setInitialValue(1 if start and tree in start else 0)
        rate[tree].setInitialValue(start.get(tree, 0.0) if start else 0.0)
    _solve(
        problem,
        "fewest-trees ILP",
        FEWEST_TREES_TIME_LIMIT_S,
        warm_start=start is not None,
        cuts=False if start is not None else None,
    )
    return {tree: rate[tree].value() for tree in trees if (kept[tree].value() or 0) > 0.5 and rate[tree].value() > 0}


def _residual_graph(graph: nx.DiGraph, residual: dict) -> nx.DiGraph:
    remaining = nx.DiGraph()
    remaining.add_nodes_from(graph.nodes)
    remaining.add_edges_from((u, v, {"capacity": c}) for (u, v), c in residual.items() if c > CAPACITY_EPS_GBPS)
    return remaining


def max_safe_weight(graph: nx.DiGraph, residual: dict, root, tree: Edges, need_gbps: float) -> float:
    """The largest rate ``w`` tree can take so the rest still packs ``need_gbps - w`` (Edmonds' cut test).

    Removing w from the tree's links must leave every root-to-v cut S with capacity >= need - w.
    A cut S crossed by t_S tree links violates this exactly when w > (c(S) - need) / (t_S - 1), so
    starting from the tree's bottleneck we lower w to that value for each violated cut found
    (a Dinkelbach-style descent that ends after a few max-flows).
    """
    tree_links = set(tree)
    weight = min(residual[e] for e in tree)
    for _ in range(4 * graph.number_of_nodes() + 8):
        trial = {e: c - (weight if e in tree_links else 0.0) for e, c in residual.items()}
        cut_graph = _residual_graph(graph, trial)
        violated = None
        for node in graph.nodes:
            if node != root:
                value, (side, _) = nx.minimum_cut(cut_graph, root, node)
                if value < need_gbps - weight - CAPACITY_EPS_GBPS:
                    violated = side
                    break
        if violated is None:
            return weight
        cut_gbps = sum(c for (a, b), c in residual.items() if a in violated and b not in violated)
        crossing = sum(1 for a, b in tree if a in violated and b not in violated)
        weight = min(weight, (cut_gbps - need_gbps) / (crossing - 1)) if crossing > 1 else 0.0
        if weight <= CAPACITY_EPS_GBPS:
            return 0.0
    return weight


def widest_tree(graph: nx.DiGraph, residual: dict, root) -> Edges | None:
    """A spanning arborescence whose narrowest residual link is as wide as possible (heavy links preferred)."""
    for threshold in sorted({c for c in residual.values() if c > CAPACITY_EPS_GBPS}, reverse=True):
        wide = nx.DiGraph()
        wide.add_nodes_from(graph.nodes)
        wide.add_edges_from(e for e, c in residual.items() if c >= threshold - CAPACITY_EPS_GBPS)
        if len(nx.descendants(wide, root)) == graph.number_of_nodes() - 1:
            return min_cost_arborescence(wide, root, {e: -residual[e] for e in wide.edges})
    return None


def _safest(graph: nx.DiGraph, residual: dict, root, trees: list, need_gbps: float) -> tuple[float, Edges]:
    """The tree that can safely carry the most; a tree's bottleneck caps it, so widest are tried first."""
    best_weight, best_tree = 0.0, None
    for tree in sorted((t for t in trees if t), key=lambda t: -min(residual[e] for e in t)):
        if min(residual[e] for e in tree) <= best_weight:
            break
        weight = max_safe_weight(graph, residual, root, tree, need_gbps)
        if weight > best_weight:
            best_weight, best_tree = weight, tree
    return best_weight, best_tree


def peel_trees(
    graph: nx.DiGraph, root, bound_gbps: float, min_share: float
) -> tuple[list[Edges], dict[Edges, float], float]:
    """Few trees with their rates, found greedily; also every tree an LP on the way used.

    Repeatedly pack the residual graph (its optimum is the residual need, by the invariant that
    every cut still holds it), take the tree of that packing that can carry the most while the
    rest still packs (:func:`max_safe_weight`), and subtract it, until ``min_share`` is carried.
    Every tree of an optimal packing is safe at least at its LP rate, so each round progresses.
    Returns (candidate trees for the ILP, the peeled trees with their rates, rate of the first,
    full LP packing).
    """
    residual = {(u, v): d["capacity"] for u, v, d in graph.edges(data=True)}
    need, candidates, packed, peeled = bound_gbps, [], None, {}
    while need > (1 - min_share) * bound_gbps + CAPACITY_EPS_GBPS:
        try:
            trees, weights = pack_trees(_residual_graph(graph, residual), root, need, candidates)
        except PlanInfeasible:  # the residual no longer spans: what is carried is all there is
            break
        used = sorted((t for t in trees if weights[t] > CAPACITY_EPS_GBPS), key=lambda t: -weights[t])
        packed = sum(weights.values()) if packed is None else packed
        candidates += [t for t in used if t not in candidates]
        if not used:
            break
        weight, tree = _safest(graph, residual, root, [widest_tree(graph, residual, root), *used], need)
        if tree is None:
            break
        if tree not in candidates:
            candidates.append(tree)
        for edge in tree:
            residual[edge] -= weight
        need -= weight
        peeled[tree] = peeled.get(tree, 0.0) + weight
    return candidates, peeled, packed or 0.0


def pack_arborescences(
    graph: nx.DiGraph, root, bound_gbps: float, min_share: float, two_way: bool = False
) -> tuple[dict[Edges, float], float]:
    """Steps 1-4: the kept trees with their rates (GB/s), and the rate of the full LP packing.
    ``two_way``: packed for an allreduce up and down the same trees (module docstring);
    ``bound_gbps`` is then only where column generation may stop early."""
    if graph.number_of_nodes() == 1:
        return {(): float("inf")}, float("inf")
    if two_way:
        return _pack_two_way(two_way_graph(graph), root, bound_gbps, min_share)
    candidates, peeled, packed = peel_trees(graph, root, bound_gbps, min_share)
    if packed <= 0:
        raise PlanInfeasible(f"no positive-rate spanning tree from {root}")
    candidates = all_arborescences(graph, root) or candidates  # small groups: the ILP is exact
    return fewest_trees_ilp(graph, candidates, packed, min_share, start=peeled), packed


def _pack_two_way(graph: nx.DiGraph, root, bound_gbps: float, min_share: float) -> tuple[dict[Edges, float], float]:
    """Two-way packing: the LP over every arborescence (small groups) or by column generation,
    then the fewest trees that carry ``min_share`` of it where n trees can, else the most rate n
    trees carry, each ILP started from a solution in hand (the LP's heaviest n trees)."""
    if len(nx.descendants(graph, root)) < graph.number_of_nodes() - 1:
        raise PlanInfeasible(f"no spanning tree from {root} over links that go both ways")
    trees = all_arborescences(graph, root)
    if trees is None:
        trees, weights = pack_trees(graph, root, bound_gbps, two_way=True)
    else:
        weights, _ = solve_packing_lp(graph, trees, two_way=True)
    packed = sum(weights.values())
    if packed <= CAPACITY_EPS_GBPS:
        raise PlanInfeasible(f"no positive-rate spanning tree from {root} over links that go both ways")
    start = {t: w for t, w in weights.items() if w > CAPACITY_EPS_GBPS}
    # The fewest trees that carry min_share, where n trees can; else the most rate n trees carry.
    # The most rate of n trees says which, so the fewest-trees ILP runs only where its answer is
    # kept (on 8 DGX-1V GPUs it needed 21 trees and took longer than all the rest of the packing).
    heaviest = sorted(start, key=lambda t: -start[t])[: graph.number_of_nodes()]
    first, _ = solve_packing_lp(graph, heaviest, two_way=True)
    kept = most_rate_ilp(graph, list(start), graph.number_of_nodes(), two_way=True, start=first)
    if sum(kept.values()) >= min_share * packed * (1 - BOUND_TOLERANCE):
        kept = fewest_trees_ilp(graph, list(start), packed, min_share, start=kept, two_way=True)
    return kept, packed


def most_rate_ilp(
    graph: nx.DiGraph,
    trees: list[Edges],
    max_trees: int,
    two_way: bool = False,
    start: dict[Edges, float] | None = None,
) -> dict[Edges, float]:
    """The most rate at most ``max_trees`` of ``trees`` carry; returns the kept trees' rates.

    Variables z_T in {0, 1}, w_T >= 0. Objective: maximise sum_T w_T. Constraints: (1) for every
    link e: sum over T loading e of w_T <= c_e; (2) w_T <= u_T z_T; (3) sum_T z_T <= max_trees.
    ``start`` (tree -> rate), a feasible solution, warm-starts CBC, which then runs without its
    cut generators: on 8 DGX-1V GPUs (28 trees) they took 0.8 s of CPU and the search with the
    start alone 0.2 s, to the same optimum.
    """
    problem = pulp.LpProblem(f"most_rate_{next(_names)}", pulp.LpMaximize)
    kept = {tree: _variable(problem, f"z_{t}", cat="Binary") for t, tree in enumerate(trees)}
    rate = {tree: _variable(problem, f"w_{t}", lowBound=0) for t, tree in enumerate(trees)}
    problem += pulp.lpSum(rate.values())
    _capacity_rows(problem, graph, {rate[t]: loaded_links(t, two_way) for t in trees})
    _kept_rows(problem, graph, trees, kept, rate, two_way)
    problem += (pulp.lpSum(kept.values()) <= max_trees, "c3_count")
    for tree in trees:
        kept[tree].setInitialValue(1 if start and tree in start else 0)
        rate[tree].setInitialValue(start.get(tree, 0.0) if start else 0.0)
    warm = start is not None
    _solve(problem, "most-rate ILP", FEWEST_TREES_TIME_LIMIT_S, warm_start=warm, cuts=False if warm else None)
    return {tree: rate[tree].value() for tree in trees if (kept[tree].value() or 0) > 0.5 and rate[tree].value() > 0}


def pack_up_and_down(
    graph: nx.DiGraph, roots: Sequence
) -> tuple[dict[Edges, float], dict[Edges, float], dict[object, float]]:
    """Broadcast trees and reduce trees packed together for an allreduce at the highest rate,
    where links differ by direction (two-way packing takes the narrower way for both), with a part
    of the data summed at each of ``roots``.

    Sets: E the directed links (capacity c_e); R the roots; for each root r, D_r arborescences out
    of r (broadcast, down) and U_r arborescences out of r in the reversed graph (reduce: its edge
    (p, c) sends c -> p). Variables: w_D, v_U >= 0 (rates), X_r >= 0 (the rate summed at r).
    Objective: maximise sum_r X_r. Constraints: (1) sum_{D_r} w_D >= X_r [alpha_r];
    (2) sum_{U_r} v_U >= X_r [beta_r]; (3) for every link e = (a, b): sum_{D contains e} w_D +
    sum_{U contains (b, a)} v_U <= c_e [y_e].
    Column generation: a down tree from r improves the rate when its y-length is below alpha_r, an
    up tree into r when its length in the reversed prices is below beta_r; both prices are
    minimum-cost arborescences.

    Why several roots: from one root every byte of the sum must arrive there and leave from there,
    so the root's links in and out bound the allreduce (on three devices joined by a ring 8x faster
    one way round, one root moves 50 where the bound of any allreduce is 67.5). A root per part,
    as a ring's reduce-scatter and all-gather have, spreads that load over every device and
    reaches 67.5 there.

    Returns (down trees, up trees, {root: X_r}) with the roots of rate > 0; each root's trees of
    each kind are scaled to carry exactly X_r (what the LP leaves over is load on no link's
    behalf), so each tree's share of its family is its rate over their sum.
    """
    reverse = graph.reverse(copy=True)
    down = {r: warm_start_trees(graph, r) for r in roots}
    up = {r: warm_start_trees(reverse, r) for r in roots}
    for _ in range(MAX_PRICING_ROUNDS):
        problem, x, w, v, names = _solve_up_and_down_lp(graph, roots, down, up)
        if not _add_priced_trees(problem, graph, reverse, roots, names, down, up):
            break
    rates = {r: x[r].value() or 0.0 for r in roots}
    rates = {r: rate for r, rate in rates.items() if rate > CAPACITY_EPS_GBPS}
    return _scaled_to_rates(w, rates), _scaled_to_rates(v, rates), rates


def _solve_up_and_down_lp(graph: nx.DiGraph, roots: Sequence, down: dict, up: dict) -> tuple:
    """The LP of :func:`pack_up_and_down` over the trees found so far, solved: the problem, its
    variables X_r, w_D, v_U (keyed by root, and by (root, tree)) and its capacity rows' names."""
    problem = pulp.LpProblem(f"up_and_down_{next(_names)}", pulp.LpMaximize)
    x = {r: _variable(problem, f"x_{i}", lowBound=0) for i, r in enumerate(roots)}
    w = {
        (r, t): _variable(problem, f"w_{i}_{j}", lowBound=0) for i, r in enumerate(roots) for j, t in enumerate(down[r])
    }
    v = {(r, t): _variable(problem, f"v_{i}_{j}", lowBound=0) for i, r in enumerate(roots) for j, t in enumerate(up[r])}
    problem += pulp.lpSum(x.values())
    for i, r in enumerate(roots):
        problem += (pulp.lpSum(w[r, t] for t in down[r]) - x[r] >= 0, f"c1_down_{i}")
        problem += (pulp.lpSum(v[r, t] for t in up[r]) - x[r] >= 0, f"c2_up_{i}")
    loads = {var: frozenset(t) for (_, t), var in w.items()}  # an up tree's edge (p, c) sends c -> p
    loads.update({var: frozenset((c, p) for p, c in t) for (_, t), var in v.items()})
    names = _capacity_rows(problem, graph, loads)
    _solve(problem, "up-and-down packing LP")
    return problem, x, w, v, names


def _add_priced_trees(
    problem: pulp.LpProblem, graph: nx.DiGraph, reverse: nx.DiGraph, roots: Sequence, names: dict, down: dict, up: dict
) -> bool:
    """Column generation of :func:`pack_up_and_down`: add to ``down`` and ``up`` each root's
    cheapest tree under the LP's dual prices where it improves the rate; whether any was added."""
    y = {e: max(_dual_price(problem, names[e]), 0.0) if e in names else 0.0 for e in graph.edges}
    priced_up = {(b, a): price for (a, b), price in y.items()}
    added = False
    for i, r in enumerate(roots):
        alpha, beta = abs(_dual_price(problem, f"c1_down_{i}")), abs(_dual_price(problem, f"c2_up_{i}"))
        tree = min_cost_arborescence(graph, r, y)
        if sum(y[e] for e in tree) < alpha - REDUCED_COST_TOLERANCE and tree not in down[r]:
            down[r].append(tree)
            added = True
        tree = min_cost_arborescence(reverse, r, priced_up)
        if sum(priced_up[e] for e in tree) < beta - REDUCED_COST_TOLERANCE and tree not in up[r]:
            up[r].append(tree)
            added = True
    return added


def _scaled_to_rates(variables: dict, rates: dict) -> dict[Edges, float]:
    """Each root's trees of one kind scaled to carry X_r (the LP may give them more)."""
    kept: dict[Edges, float] = {}
    for r, rate in rates.items():
        mine = {t: var.value() or 0.0 for (root, t), var in variables.items() if root == r}
        total = sum(mine.values())
        kept.update({t: w * rate / total for t, w in mine.items() if w * rate / total > CAPACITY_EPS_GBPS})
    return kept
