//! The outcome head: reading prompts, parsing records, fitting and checking.

use super::*;
use crate::classifier::check_fit;

#[test]
fn reads_quantities_choices_and_statements() {
    let gsm = OutcomeInputs::of_text(
        "Sam buys 3 apples at $1.50 each and 1/2 of a pie. How much does he pay?",
        4096,
    );
    let mcq = OutcomeInputs::of_text(
        "Statement 1 | Every group is cyclic. Which is NOT true?\nA. 12\nB. x\nC. 4\nD. none",
        4096,
    );
    let at = |name: &str| OUTCOME_FEATURES.iter().position(|n| *n == name).unwrap();
    assert_eq!(gsm.0[at("choices")], 0.0);
    assert_eq!(mcq.0[at("choices")], 1.0);
    assert!(gsm.0[at("quantities")] > mcq.0[at("quantities")] * 0.0);
    assert!(gsm.0[at("decimals")] > 0.0 && gsm.0[at("fractions")] > 0.0);
    assert!(gsm.0[at("relations")] > 0.0 && gsm.0[at("money_percent")] > 0.0);
    assert_eq!(mcq.0[at("statements")], 1.0);
    assert!(mcq.0[at("negations")] > 0.0);
    assert!(mcq.0[at("numeric_choices")] > 0.0);
    assert_eq!(gsm.0[at("numeric_choices")], 0.0);
    assert!(gsm
        .0
        .iter()
        .chain(&mcq.0)
        .all(|v| v.is_finite() && *v >= 0.0));
}

#[test]
fn fitting_is_deterministic_and_learns_the_direction() {
    let records: Vec<OutcomeRecord> = (0..200)
        .map(|i| {
            let n = i % 8;
            let prompt = (0..=n).map(|k| format!("{k} apples. ")).collect::<String>();
            OutcomeRecord {
                id: i.to_string(),
                source: "s".into(),
                category: "c".into(),
                prompt,
                inputs: None,
                task_class: None,
                verdicts: correct(n < 4 || i % 5 == 0, true),
            }
        })
        .collect();
    let refs: Vec<&OutcomeRecord> = records.iter().collect();
    let classes = vec![TaskClass::Math; refs.len()];
    let a = fit_outcomes(&refs, &classes, 4096);
    assert_eq!(a, fit_outcomes(&refs, &classes, 4096));
    let easy = a.logit(&OutcomeInputs::of_text("1 apples.", 4096), TaskClass::Math);
    let hard = a.logit(
        &OutcomeInputs::of_text(
            "1 apples. 2 apples. 3 apples. 4 apples. 5 apples. 6 apples. 7 apples.",
            4096,
        ),
        TaskClass::Math,
    );
    assert!(hard > easy, "{hard} <= {easy}");
    assert!(OutcomeHead::risk_of(hard) > OutcomeHead::risk_of(easy));
    assert!(a.check().is_ok());
}

/// A multiple-choice question of `category`: long or short, with or without a negation.
fn question(i: usize, long: bool, not: bool, verdicts: (bool, bool)) -> OutcomeRecord {
    let stem = if long {
        "Which property of the described system holds, given the lengthy setup above"
    } else {
        "Which holds"
    };
    let not = if not { " NOT" } else { "" };
    OutcomeRecord {
        id: i.to_string(),
        source: "s".into(),
        category: if long { "long" } else { "short" }.into(),
        prompt: format!("{stem}{not}?\nA. one\nB. two\nC. three\nD. four\nAnswer:"),
        inputs: None,
        task_class: None,
        verdicts: correct(verdicts.0, verdicts.1),
    }
}

fn correct(cheap: bool, reference: bool) -> Verdicts {
    Verdicts::Correct { cheap, reference }
}

fn fit_reasoning(records: &[OutcomeRecord]) -> OutcomeHead {
    let refs: Vec<&OutcomeRecord> = records.iter().collect();
    fit_outcomes(&refs, &vec![TaskClass::Reasoning; refs.len()], 4096)
}

/// Between the two categories, length says almost everything (the long one's questions
/// need the reference far more often); within each, a negation adds a little. The trees
/// learn the within-category difference, which is all that ranks a workload of one kind.
#[test]
fn choice_trees_rank_within_a_category_not_between() {
    let (need, agree, cheap_only) = ((false, true), (true, true), (true, false));
    let mut records = Vec::new();
    for i in 0..40 {
        records.push(question(i, true, true, need));
        records.push(question(
            100 + i,
            true,
            false,
            if i < 30 { need } else { agree },
        ));
        records.push(question(
            200 + i,
            false,
            true,
            if i < 10 { agree } else { cheap_only },
        ));
        records.push(question(300 + i, false, false, cheap_only));
    }
    let head = fit_reasoning(&records);
    assert_eq!(head, fit_reasoning(&records));
    assert!(head.choice_trees.is_some() && head.check().is_ok());
    let logit = |r: OutcomeRecord| {
        head.logit(
            &OutcomeInputs::of_text(&r.prompt, 4096),
            TaskClass::Reasoning,
        )
    };
    let short_not = logit(question(0, false, true, agree));
    let long_plain = logit(question(0, true, false, agree));
    assert!(short_not > long_plain, "{short_not} <= {long_plain}");
    assert!(logit(question(0, true, true, agree)) > long_plain);
    // Calibrated on the records as a whole: the mean target is 0.46, a risk near zero.
    let risk = OutcomeHead::risk_of(logit(question(0, true, true, agree)));
    assert!((0.0..0.5).contains(&risk), "{risk}");
}

#[test]
fn a_head_without_trees_scores_choices_linearly_and_bad_trees_are_named() {
    let records: Vec<OutcomeRecord> = (0..80)
        .map(|i| question(i, i % 2 == 0, i % 3 == 0, (i % 4 == 0, true)))
        .collect();
    let head = fit_reasoning(&records);
    let mut json = serde_json::to_value(&head).unwrap();
    json.as_object_mut().unwrap().remove("choice_trees");
    let linear: OutcomeHead = serde_json::from_value(json).unwrap();
    assert!(linear.choice_trees.is_none() && linear.check().is_ok());
    let inputs = OutcomeInputs::of_text(&records[0].prompt, 4096);
    let row: f32 = linear
        .choices
        .weights
        .iter()
        .zip(&inputs.0)
        .map(|(w, x)| w * x)
        .sum();
    let class = TaskClass::Reasoning;
    assert_eq!(
        linear.logit(&inputs, class),
        f64::from(row + linear.choices.bias)
    );
    assert_ne!(head.logit(&inputs, class), linear.logit(&inputs, class));
    let broken = |edit: fn(&mut ChoiceTrees)| {
        let mut head = head.clone();
        edit(head.choice_trees.as_mut().unwrap());
        head.check().unwrap_err().0
    };
    let at = "weights.outcome.choice_trees";
    assert_eq!(broken(|t| t.trees[0].inputs[0] = OUTCOME_INPUTS as u8), at);
    assert_eq!(broken(|t| t.trees[0].leaves.push(0.0)), at);
    assert_eq!(broken(|t| t.trees[1].thresholds[2] = f32::NAN), at);
    assert_eq!(broken(|t| t.depth = trees::MAX_TREE_DEPTH + 1), at);
}

#[test]
fn outcome_lines_take_either_name_and_default_the_rest() {
    let rows = parse_outcomes(
        "{\"prompt\": \"a\", \"cheap_ok\": false, \"reference_ok\": true}\n\n\
         {\"id\": \"x\", \"source\": \"s\", \"category\": \"c\", \"prompt\": \"b\", \
         \"weak_correct\": true, \"strong_correct\": true, \"extra\": 1}",
    )
    .unwrap();
    assert_eq!(rows[0].id, "line-1");
    assert_eq!(rows[0].source, "unknown");
    assert!(rows[0].target() > 0.99);
    assert_eq!(rows[1].target(), 0.5);
    assert!(matches!(
        parse_outcomes("{\"prompt\": \"a\"}"),
        Err(DataError::Line { line: 1, .. })
    ));
}

#[test]
fn traffic_records_read_their_inputs_and_refuse_another_feature_list() {
    let inputs = OutcomeInputs::of_text("Sam buys 3 apples at $1.50 each.", 4096);
    let line = serde_json::json!({"features": inputs.named(), "inputs": OUTCOME_INPUTS,
        "task_class": "math", "cheap_profile": "a", "reference_profile": "b",
        "agreed": false});
    let rows = parse_outcomes(&line.to_string()).unwrap();
    assert_eq!(rows[0].inputs, Some(inputs));
    assert_eq!(rows[0].inputs(4096), inputs);
    assert_eq!(rows[0].verdicts, correct(false, true));
    assert_eq!(
        (rows[0].source.as_str(), rows[0].category.as_str()),
        ("traffic", "math")
    );

    let mut renamed = line.clone();
    renamed["features"]["bogus"] = 0.5.into();
    let error = parse_outcomes(&renamed.to_string())
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("`bogus`") && error.contains("another feature list"),
        "{error}"
    );
    let mut counted = line.clone();
    counted["inputs"] = (OUTCOME_INPUTS + 1).into();
    let error = parse_outcomes(&counted.to_string())
        .unwrap_err()
        .to_string();
    assert!(error.contains("41 inputs"), "{error}");
    let mut classless = line;
    classless.as_object_mut().unwrap().remove("task_class");
    assert!(parse_outcomes(&classless.to_string()).is_err());
}

fn at(name: &str) -> usize {
    OUTCOME_FEATURES.iter().position(|n| *n == name).unwrap()
}

#[test]
fn reads_the_kind_of_ask_its_constraints_and_its_code() {
    let story = OutcomeInputs::of_text(
        "Write a short story about a lighthouse keeper. Keep it brief.",
        4096,
    );
    let fix = OutcomeInputs::of_text(
        "Fix this error in my Python function, without changing its signature:\n\
         ```\ndef total(xs):\n    return sum(xs) +\n```\n\
         Requirements:\n- it must handle an empty list\n- it must not use a loop\n\
         Explain the bug in detail, then give the code as a table.",
        4096,
    );
    for name in ["ask_create", "creative", "short_answer"] {
        assert!(story.0[at(name)] > 0.0, "{name}");
        assert_eq!(fix.0[at(name)], 0.0, "{name}");
    }
    for name in [
        "ask_fix",
        "ask_explain",
        "constraints",
        "steps",
        "long_answer",
        "format",
        "code_words",
        "list_items",
        "code_lines",
        "code_symbols",
        "code_fences",
    ] {
        assert!(fix.0[at(name)] > 0.0, "{name}");
        assert_eq!(story.0[at(name)], 0.0, "{name}");
    }
    assert!(fix.0[at("lines")] > story.0[at("lines")]);
    assert_eq!(story.0[at("non_ascii")], 0.0);
    // Other languages: their words are in none of the (English) vocabularies.
    let other = OutcomeInputs::of_text("Écris un poème sur la mer, s'il te plaît.", 4096);
    assert!(other.0[at("non_ascii")] > 0.0 && other.0[at("creative")] == 0.0);
}

/// A record claiming an input outside the range is refused, so every input a prompt can
/// give must lie in it, however the window is filled.
#[test]
fn every_input_stays_in_its_range_whatever_the_window_holds() {
    let fill = |piece: &str| piece.repeat(OUTCOME_WINDOW / piece.len() + 1);
    for text in [
        fill("("),
        fill("1/2 "),
        fill("9"),
        fill("x"),
        fill("é"),
        fill("```"),
        fill("- a\n"),
        fill("  x;\n"),
        fill("A. 1\n"),
        fill("must write fix solve "),
        fill("Statement 1 is not true? "),
        fill("$% {}[];_+-*/=^<>"),
    ] {
        let inputs = OutcomeInputs::of_text(&text, 1 << 20);
        for (name, v) in OUTCOME_FEATURES.iter().zip(inputs.0) {
            assert!(
                INPUT_RANGE.contains(&v),
                "{name} = {v} for {:?}",
                &text[..12]
            );
        }
    }
}

#[test]
fn graded_lines_target_the_share_of_the_grade_lost() {
    let rows = parse_outcomes(
        "{\"prompt\": \"a\", \"weak_grade\": 3, \"strong_grade\": 9}\n\
         {\"prompt\": \"b\", \"cheap_grade\": 8, \"reference_grade\": 8}\n\
         {\"prompt\": \"c\", \"weak_grade\": 10, \"strong_grade\": 6}",
    )
    .unwrap();
    let targets: Vec<f64> = rows.iter().map(OutcomeRecord::target).collect();
    let close = |a: f64, b: f64| (a - b).abs() < 1e-6;
    assert!(close(targets[0], 0.8) && close(targets[1], 0.5) && close(targets[2], 0.3));
    assert_eq!(rows[0].verdicts.scores().0, f64::from(0.3f32));
    // Right and wrong is the same scale: a lost right answer is the whole of it.
    assert_eq!(correct(false, true).target(), 1.0);
    assert_eq!(correct(true, true).target(), 0.5);
    for bad in [
        "{\"prompt\": \"a\", \"weak_grade\": 11, \"strong_grade\": 9}",
        "{\"prompt\": \"a\", \"weak_grade\": -1, \"strong_grade\": 9}",
        "{\"prompt\": \"a\", \"weak_grade\": 3}",
        "{\"prompt\": \"a\", \"weak_grade\": 3, \"strong_grade\": 9, \"weak_correct\": true, \
         \"strong_correct\": true}",
    ] {
        assert!(
            matches!(parse_outcomes(bad), Err(DataError::Line { line: 1, .. })),
            "{bad}"
        );
    }
}

/// Issue: a finite but absurd feature value (3e38) was accepted, and the head trained on it
/// came out all zeros.
#[test]
fn a_record_with_an_absurd_value_is_refused_with_its_line() {
    let line = |value: f32| {
        serde_json::json!({"features": {"length": 0.5, "quantities": value},
            "inputs": OUTCOME_INPUTS, "task_class": "math", "cheap_profile": "a",
            "reference_profile": "b", "agreed": false})
        .to_string()
    };
    let good = line(0.4);
    assert!(parse_outcomes(&good).is_ok());
    for value in [3e38, -0.5, 4.5] {
        let text = format!("{good}\n{}\n", line(value));
        let error = parse_outcomes(&text).unwrap_err();
        assert!(matches!(error, DataError::Line { line: 2, .. }), "{error}");
        assert!(error.to_string().contains("`quantities`"), "{error}");
    }
}

/// Word problems and open-ended requests are scored by rows of their own: here the number
/// of quantities makes a word problem hard and a long request easy, which one row could
/// not both learn.
#[test]
fn each_kind_of_prompt_is_scored_by_its_own_row() {
    let mut examples = Vec::new();
    for i in 0..120 {
        let hard = i % 2 == 0;
        let problem = (0..if hard { 6 } else { 1 })
            .map(|k| format!("Ann has {k} pens. "))
            .collect::<String>();
        let request = match hard {
            true => "Write a poem.".to_owned(),
            false => "Write a poem about the sea and the wind. ".repeat(6),
        };
        for (text, class) in [(problem, TaskClass::Math), (request, TaskClass::General)] {
            examples.push(OutcomeExample {
                inputs: OutcomeInputs::of_text(&text, 4096),
                task_class: class,
                verdicts: correct(!hard || i % 6 == 0, true),
                category: "c",
            });
        }
    }
    let head = fit_examples(&examples);
    let logit = |text: &str, class| head.logit(&OutcomeInputs::of_text(text, 4096), class);
    let long_problem = "Ann has 1 pen. Bo has 2. Cy has 3. Di has 4. Ed has 5. Flo has 6.";
    assert!(logit(long_problem, TaskClass::Math) > logit("Ann has 1 pen.", TaskClass::Math));
    let long_request = "Write a poem about the sea and the wind. ".repeat(6);
    assert!(logit("Write a poem.", TaskClass::Code) > logit(&long_request, TaskClass::Code));
    let apgr = check_fit(&head, &examples).unwrap().unwrap();
    // One row for both kinds ranks them worse.
    let pooled: Vec<OutcomeExample<'_>> = examples
        .iter()
        .map(|e| OutcomeExample {
            task_class: TaskClass::General,
            ..*e
        })
        .collect();
    let one_row = check_fit(&fit_examples(&pooled), &pooled).unwrap().unwrap();
    assert!(apgr > one_row + 0.05, "{apgr} against {one_row}");
    // A kind without records takes the row all of them share.
    let math_only: Vec<OutcomeExample<'_>> = examples
        .iter()
        .filter(|e| e.task_class == TaskClass::Math)
        .copied()
        .collect();
    let head = fit_examples(&math_only);
    assert_ne!(head.open, head.math);
    let shared = fit_examples(
        &math_only
            .iter()
            .map(|e| OutcomeExample {
                task_class: TaskClass::Code,
                ..*e
            })
            .collect::<Vec<_>>(),
    );
    assert_eq!(head.open, shared.math);
}

#[test]
fn a_head_that_learned_nothing_is_refused() {
    let examples: Vec<OutcomeExample<'_>> = (0..60)
        .map(|i| OutcomeExample {
            inputs: OutcomeInputs::of_text(&"Ann has 3 pens. ".repeat(1 + i % 5), 4096),
            task_class: TaskClass::Math,
            verdicts: correct(true, true),
            category: "c",
        })
        .collect();
    // Every answer agreed: nothing to rank by.
    let head = fit_examples(&examples);
    assert_eq!(head.degenerate(), Some(DegenerateHead::Constant));
    assert_eq!(check_fit(&head, &examples), Err(DegenerateHead::Constant));
    // A head that ranks its records backwards.
    let varied: Vec<OutcomeExample<'_>> = examples
        .iter()
        .enumerate()
        .map(|(i, e)| OutcomeExample {
            verdicts: correct(i % 5 < 2, true),
            ..*e
        })
        .collect();
    let mut head = fit_examples(&varied);
    assert!(check_fit(&head, &varied).unwrap().unwrap() > 0.5);
    for w in &mut head.math.weights {
        *w = -*w;
    }
    assert!(matches!(
        check_fit(&head, &varied),
        Err(DegenerateHead::WorseThanRandom(apgr)) if apgr < 0.5
    ));
    head.open.weights[0] = f32::NAN;
    assert!(matches!(
        head.degenerate(),
        Some(DegenerateHead::Invalid("weights.outcome.open", _))
    ));
}

#[test]
fn the_scored_text_is_the_ask_first_within_the_window() {
    use crate::features::{Prompt, Role, Segment};
    let history = "é".repeat(3000);
    let ask = "How many apples? ".repeat(200);
    let prompt = Prompt {
        segments: vec![
            Segment {
                role: Role::Assistant,
                text: &history,
            },
            Segment {
                role: Role::User,
                text: &ask,
            },
        ],
        wants_json: false,
    };
    let text = OutcomeInputs::scored_text(&prompt, 1 << 20);
    // The ask fills the window; the history gets what is left of its share, whole chars.
    assert!(text.starts_with("How many apples?"));
    assert!(text.len() <= OUTCOME_WINDOW + 2, "{}", text.len());
    assert_eq!(
        OutcomeInputs::of_text(&text, OUTCOME_WINDOW),
        OutcomeInputs::of(&prompt, 1 << 20)
    );
    assert!(OutcomeInputs::scored_text(&prompt, 10).len() <= 10);
}
