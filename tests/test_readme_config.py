"""The README's configuration reference keeps step with the configuration model: every key
has a row naming its default, environment variable and flag; the price table's date is the
shipped table's."""

from __future__ import annotations

from pathlib import Path

from turnstile.streams import config_file

README = (Path(__file__).parent.parent / "README.md").read_text()


def rows() -> dict[str, list[str]]:
    """The reference table's rows, by their key cell's first code span."""
    found = {}
    for line in README.splitlines():
        if line.startswith("| `") and "`TURNSTILE_" in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            found[cells[0].split("`")[1]] = cells
    return found


def default_of(path: config_file.KeyPath) -> object:
    value: object = config_file.Config()
    for part in path:
        value = getattr(value, part)
    return value


def test_every_key_is_in_the_readme_with_its_default_env_name_and_flag():
    table = rows()
    for path in config_file.key_paths():
        key = 'prices."MODEL"' if path == ("prices",) else config_file.dotted(path)
        assert key in table, f"{key} is missing from the README's configuration reference"
        _, default, env, flag, _ = table[key]
        assert f"`{config_file.env_name(path)}`" in env, key
        assert f"`{config_file.FLAGS[path]}" in flag, key
        value = default_of(path)
        if value in (None, (), {}):
            assert default == "—", key
        elif isinstance(value, bool):
            assert default == f"`{str(value).lower()}`", key
        else:
            assert default == f"`{value:g}`" if isinstance(value, float) else default == f"`{value}`", key
    assert len(table) == len(list(config_file.key_paths()))  # and no row of a key that is gone


def test_the_readme_gives_the_price_tables_date_and_the_precedence():
    assert f"taken on {config_file.shipped_prices().taken.isoformat()}" in README
    assert "flags > environment > file > defaults" in README
