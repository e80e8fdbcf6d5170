use serde_json::json;

use super::*;

fn expect(kind: MatchKind, expected: Value) -> Expected {
    Expected::parse(kind, &expected).unwrap()
}

#[test]
fn exact_ignores_case_wrapping_and_a_final_period() {
    let yes = expect(MatchKind::Exact, json!("yes"));
    for answer in ["yes", "Yes.", " YES ", "**Yes**", "`yes`", "\"yes\"!"] {
        assert!(yes.judge(answer), "{answer:?}");
    }
    for answer in ["no", "yes, probably", "yess", ""] {
        assert!(!yes.judge(answer), "{answer:?}");
    }
    let code = expect(MatchKind::Exact, json!("daerht"));
    assert!(code.judge("'daerht'"));
    assert!(expect(MatchKind::Exact, json!(5)).judge("5"));
    assert!(!expect(MatchKind::Exact, json!("Hanoi Vietnam")).judge("hanoi, vietnam"));
}

#[test]
fn number_takes_the_last_number_and_compares_numerically() {
    let n = expect(MatchKind::Number, json!(1181));
    for answer in [
        "1181",
        "The answer is 1181.",
        "358 + 823 = 1,181",
        "**1181**",
        "First 358, then 823: total 1181.0",
        "$1,181",
    ] {
        assert!(n.judge(answer), "{answer:?}");
    }
    for answer in [
        "1181 is close, but it is 1182",
        "eleven eighty-one",
        "",
        "1180",
    ] {
        assert!(!n.judge(answer), "{answer:?}");
    }
    let negative = expect(MatchKind::Number, json!(-697));
    assert!(negative.judge("109 - 806 = -697"));
    assert!(!negative.judge("x-697"));
    assert!(expect(MatchKind::Number, json!("2.5")).judge("It takes 2.50 hours."));
    assert!(expect(MatchKind::Number, json!(0.3)).judge("0.30000000000000004"));
}

#[test]
fn last_number_reads_signs_groups_and_decimals() {
    assert_eq!(last_number("5, 8, 13"), Some(13.0));
    assert_eq!(last_number("1,234,567 items"), Some(1_234_567.0));
    assert_eq!(last_number("1,23"), Some(23.0));
    assert_eq!(last_number("it is -4.5."), Some(-4.5));
    assert_eq!(last_number("5-3"), Some(3.0));
    assert_eq!(last_number("ends with 42."), Some(42.0));
    assert_eq!(last_number("no digits"), None);
}

#[test]
fn contains_needs_whole_words_and_accepts_any_listed_answer() {
    let paris = expect(MatchKind::Contains, json!("Paris"));
    assert!(paris.judge("The capital of France is Paris."));
    assert!(paris.judge("paris"));
    assert!(!paris.judge("Parisian cafes"));
    assert!(!paris.judge("Lyon"));
    let gold = expect(MatchKind::Contains, json!("Au"));
    assert!(
        !gold.judge("because"),
        "a substring inside a word is not a match"
    );
    let any = expect(MatchKind::Contains, json!(["carbon dioxide", "CO2"]));
    assert!(any.judge("Plants take in CO2."));
    assert!(any.judge("carbon   dioxide"));
    assert!(!any.judge("oxygen"));
}

#[test]
fn json_needs_valid_json_with_the_expected_keys_fenced_or_not() {
    let keys = expect(MatchKind::Json, json!(["name", "age"]));
    assert!(keys.judge(r#"{"name": "Ada", "age": 36, "extra": true}"#));
    assert!(keys.judge("```json\n{\"name\": \"Ada\", \"age\": 36}\n```"));
    assert!(keys.judge("Here it is:\n```\n{\"name\": \"Ada\", \"age\": 36}\n```\nDone."));
    assert!(!keys.judge(r#"{"name": "Ada"}"#), "a key is missing");
    assert!(
        !keys.judge(r#"{"name": "Ada", "age": 36"#),
        "not valid JSON"
    );
    assert!(!keys.judge(r#"["name", "age"]"#), "not an object");
    let object = expect(
        MatchKind::Json,
        json!({"name": "x", "address": {"city": "y"}}),
    );
    assert!(object.judge(r#"{"name": "Bo", "address": {"city": "Oslo", "zip": "0150"}}"#));
    assert!(!object.judge(r#"{"name": "Bo", "address": {"street": "Main"}}"#));
    assert!(!object.judge(r#"{"name": "Bo", "address": "Oslo"}"#));
}

#[test]
fn expected_values_are_checked_against_their_kind() {
    assert!(Expected::parse(MatchKind::Number, &json!("forty")).is_err());
    assert!(Expected::parse(MatchKind::Number, &json!("40")).is_ok());
    assert!(Expected::parse(MatchKind::Exact, &json!({"a": 1})).is_err());
    assert!(Expected::parse(MatchKind::Contains, &json!([])).is_err());
    assert!(Expected::parse(MatchKind::Contains, &json!("  ")).is_err());
    assert!(Expected::parse(MatchKind::Json, &json!("name")).is_err());
    assert!(Expected::parse(MatchKind::Json, &json!(["name", 3])).is_err());
}

#[test]
fn agreement_applies_the_items_check_to_the_reference_answer() {
    assert!(agree(MatchKind::Number, "So it is 42.", "The answer is 42"));
    assert!(!agree(
        MatchKind::Number,
        "The answer is 41.",
        "The answer is 42"
    ));
    assert!(agree(MatchKind::Exact, "Yes.", "yes"));
    assert!(!agree(MatchKind::Exact, "no", "yes"));
    assert!(agree(
        MatchKind::Json,
        r#"{"name": "Ada", "age": 36}"#,
        "```json\n{\"age\": 35, \"name\": \"Ada L\"}\n```"
    ));
    assert!(!agree(
        MatchKind::Json,
        r#"{"name": "Ada"}"#,
        r#"{"name": "Ada", "age": 36}"#
    ));
    assert!(agree(MatchKind::Contains, "The capital is Paris.", "Paris"));
    assert!(!agree(MatchKind::Contains, "Lyon.", "Paris."));
}

#[test]
fn agreement_falls_back_to_prose_similarity() {
    // The reference gives no number (or no JSON) to compare: compare the words.
    assert!(agree(
        MatchKind::Number,
        "I cannot tell from the question",
        "I cannot tell from this question"
    ));
    assert!(!agree(MatchKind::Json, "sorry, no", "I cannot do that"));
    let a = "Quantization lowers memory use and speeds up decoding";
    let b = "quantization lowers memory use, and it speeds up decoding!";
    assert!(similarity(a, b) >= PROSE_AGREEMENT);
    assert!(agree(MatchKind::Contains, a, b));
    assert!(!agree(
        MatchKind::Contains,
        a,
        "The tower of Babel is a myth about language"
    ));
}

#[test]
fn similarity_is_dice_over_word_multisets() {
    assert_eq!(similarity("", ""), 1.0);
    assert_eq!(similarity("a b", ""), 0.0);
    assert_eq!(similarity("the cat sat", "The cat sat."), 1.0);
    assert_eq!(similarity("a a b", "a b b"), 2.0 * 2.0 / 6.0);
}

#[test]
fn normalise_strips_nested_wrapping() {
    assert_eq!(normalise("  **\"Thursday\"**. "), "thursday");
    assert_eq!(normalise("New   Delhi"), "new delhi");
    assert_eq!(normalise("\""), "\"");
}
