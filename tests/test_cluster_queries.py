from felactl.spec import ClusterSpec, LinkType, from_dict


def _cluster():
    dev = lambda name: {"name": name, "kind": "cuda", "model": "V100", "tflops": 14, "memory_gb": 16}
    return from_dict(
        ClusterSpec,
        {
            "name": "two-boxes",
            "nodes": [{"name": "a", "devices": [dev("a0"), dev("a1")]}, {"name": "b", "devices": [dev("b0")]}],
            "links": [
                {"src": "a0", "dst": "a1", "bandwidth_gbps": 50, "latency_us": 2, "type": "nvlink", "num_links": 2}
            ],
            "intra_node_default": {"bandwidth_gbps": 10, "latency_us": 5, "type": "pcie"},
            "inter_node_default": {"bandwidth_gbps": 12.5, "latency_us": 30, "type": "net"},
        },
        "c.yaml",
    )


def test_listed_link_wins_over_defaults():
    c = _cluster()
    assert c.link("a0", "a1").bandwidth_gbps == 50
    assert c.link("a1", "a0").type is LinkType.PCIE  # only one direction listed
    assert c.link("a0", "b0").type is LinkType.NET and c.link("b0", "a1").bandwidth_gbps == 12.5
    assert c.link("a0", "a0") is None


def test_links_among_covers_every_ordered_pair_once():
    c = _cluster()
    links = c.links_among(c.device_names)
    assert len(links) == 6
    assert len({(l.src, l.dst) for l in links}) == 6


def test_subset_keeps_defaults_and_drops_empty_nodes():
    c = _cluster().subset(["a1", "b0"])
    assert [n.name for n in c.nodes] == ["a", "b"] and c.device_names == ("a1", "b0")
    assert c.link("a1", "b0").type is LinkType.NET
    assert _cluster().subset(["a0", "a1"]).nodes[-1].name == "a"
