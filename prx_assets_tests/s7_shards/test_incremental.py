

def test_mds_uri_prints_the_resolved_current_tree(data_root, capsys):
    from prx_assets import cli

    assert cli.main(["mds-uri", "web"]) == 2  # no tree yet: a clear error, not a traceback
    assert "materialise mds_shards first" in capsys.readouterr().err
    build_corpus(data_root, "web", per_shape=2)
    report = mds.write_mds_tree(inputs_for(data_root, "web"), data_root, "web", OPTIONS)
    assert cli.main(["mds-uri", "web"]) == 0
    uri = capsys.readouterr().out.strip()
    assert uri == str(report.path) and not os.path.islink(uri)  # resolved: stable under swaps
    dataset = StreamingDataset(remote=None, local=f"{uri}/1/64x64", batch_size=1, shuffle=False)
    assert dataset.num_samples == sum(r["leaf"] == "1/64x64" for r in mapping(data_root))
    del dataset
